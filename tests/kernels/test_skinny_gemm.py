"""The skinny GEMM kernel against F.linear, and the dispatch around it.

Interpreter on CPU in CI (fp32, small shapes); natively on a GPU host (bf16,
the Qwen3-0.6B projection shapes too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.skinny_gemm import (
    MAX_M,
    GemvConfig,
    GemvPlan,
    SkinnyLinear,
    bucket,
    default_config,
    linear,
)
from engine.layers.skinny_gemm_plan import choose, plan_model
from engine.layers.specs import GemvBackend

sk = pytest.importorskip("engine.layers.skinny_gemm_kernels", reason="triton is not installed")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32

CONFIGS = [
    GemvConfig(block_n=16, block_k=32),  # FMA, one split
    GemvConfig(block_n=8, block_k=64, split_k=2),  # FMA, split K (a reduce kernel)
    GemvConfig(block_n=16, block_k=32, split_k=3),  # an odd split: uneven shares of K
    GemvConfig(block_n=16, block_k=32, use_dot=True),  # a 16-row tensor-core tile
    GemvConfig(block_n=32, block_k=64, split_k=2, use_dot=True),
]
SHAPES = [(96, 64), (40, 200)]  # N x K: even and ragged (N and K not tile multiples)
if ON_GPU:
    SHAPES += [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # Qwen3-0.6B's


def reference(x, w, b):
    return F.linear(x.float(), w.float(), b.float() if b is not None else None)


def assert_close(out, ref):
    tol = 2e-2 if ON_GPU else 1e-4
    assert out.shape == ref.shape and out.dtype == DTYPE
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_kernel_matches_f_linear(cfg, n, k, m):
    torch.manual_seed(m)
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.05
    assert_close(sk.skinny_gemm(x, w, None, cfg), reference(x, w, None))


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]], ids=str)
def test_bias_and_leading_dims_and_strided_rows(cfg):
    x = torch.randn(2, 3, 200, device=DEVICE, dtype=DTYPE)  # 6 tokens in a [2, 3] batch
    w = torch.randn(40, 200, device=DEVICE, dtype=DTYPE) * 0.05
    b = torch.randn(40, device=DEVICE, dtype=DTYPE)
    assert_close(sk.skinny_gemm(x, w, b, cfg), reference(x, w, b))
    # Rows of a wider tensor (stride > K), as a split of a fused projection gives.
    wide = torch.randn(5, 260, device=DEVICE, dtype=DTYPE)
    assert_close(sk.skinny_gemm(wide[:, :200], w, b, cfg), reference(wide[:, :200], w, b))


def test_default_configs_cover_the_gpu_and_split_only_narrow_weights():
    for m in range(1, MAX_M + 1):
        for n, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (28672, 4096)]:
            cfg = default_config(m, n, k, num_sms=132)
            assert cfg.use_dot == (m > 4)
            tiles = -(-n // cfg.block_n)
            assert tiles * cfg.split_k >= 132 // 2, (m, n, k, cfg)
            assert cfg.split_k == 1 or tiles < 132 // 2
    # A 256-row weight leaves most SMs idle at any width: its K is split.
    assert default_config(1, 256, 4096, num_sms=132).split_k > 1


def test_plan_buckets_token_counts():
    a, b = GemvConfig(16, 32), GemvConfig(32, 64)
    plan = GemvPlan({1: a, 2: None, 4: b, 8: None, 16: b})
    assert [bucket(m) for m in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert plan.config_for(1) is a and plan.config_for(2) is None
    assert plan.config_for(3) is b and plan.config_for(12) is b
    assert plan.config_for(0) is None and plan.config_for(MAX_M + 1) is None


def test_linear_dispatches_by_plan(monkeypatch):
    calls = []
    real = sk.skinny_gemm

    def spy(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(sk, "skinny_gemm", spy)
    w = torch.randn(40, 200, device=DEVICE, dtype=DTYPE) * 0.05
    plan = GemvPlan({1: GemvConfig(16, 32), 2: None, 4: GemvConfig(8, 64, 2), 8: None, 16: None})
    for m in (1, 2, 3, 5, 20):
        x = torch.randn(m, 200, device=DEVICE, dtype=DTYPE)
        out = linear(x, w, None, plan)
        assert_close(out, reference(x, w, None))
        assert torch.equal(linear(x, w), F.linear(x, w))  # no plan: F.linear itself
    assert calls == [1, 3]  # m=2, 5 (bucket 8) and 20 (> MAX_M) went to F.linear
    # An input in another dtype than the weight is never the kernel's: F.linear says no.
    with pytest.raises(RuntimeError):
        linear(torch.randn(1, 200, device=DEVICE, dtype=torch.float64), w, None, plan)
    assert calls == [1, 3]


def test_skinny_linear_is_an_nn_linear_routed_through_the_plan(monkeypatch):
    layer = SkinnyLinear(200, 40, bias=True).to(DEVICE, DTYPE)
    with torch.no_grad():  # SkinnyLinear leaves its parameters to the loader
        layer.weight.normal_()
        layer.bias.normal_()
    plain = torch.nn.Linear(200, 40, bias=True)
    assert layer.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(1, 200, device=DEVICE, dtype=DTYPE)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.gemv_plan = GemvPlan({m: GemvConfig(16, 32) for m in (1, 2, 4, 8, 16)})
        assert_close(layer(x), reference(x, layer.weight, layer.bias))


def test_table_entries_decide_by_the_measured_times():
    cfg = GemvConfig(16, 256, 1, 4, 3, False)
    faster = {"config": cfg.to_dict(), "triton_us": 3.0, "cublas_us": 5.0}
    slower = {"config": cfg.to_dict(), "triton_us": 4.95, "cublas_us": 5.0}  # within MARGIN
    assert choose(faster, GemvBackend.AUTO) == (True, cfg)
    assert choose(slower, GemvBackend.AUTO) == (True, None)
    assert choose(slower, GemvBackend.TRITON) == (True, cfg)  # forced: the tuned config
    assert choose(None, GemvBackend.AUTO) == (False, None)
    assert choose({"config": None, "triton_us": None, "cublas_us": 5.0}, GemvBackend.AUTO) == (
        False,
        None,
    )


@pytest.mark.skipif(ON_GPU, reason="the CPU rule; tests/gpu covers planning on CUDA")
def test_no_plan_off_cuda():
    model = torch.nn.Sequential(SkinnyLinear(64, 32), SkinnyLinear(32, 64))
    model[0].gemv_plan = GemvPlan({1: GemvConfig(16, 32)})  # stale: cleared
    for backend in GemvBackend:
        assert plan_model(model, backend, torch.device("cpu"), torch.bfloat16) == {}
        assert model[0].gemv_plan is None and model[1].gemv_plan is None
