"""Fused Triton ops (RMSNorm(+residual), SiLU-and-mul, q/k-norm + RoPE) against the
torch ops they replace. Interpreter on CPU in CI; natively on a GPU host."""

from __future__ import annotations

import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.specs import RopeConfig

fk = pytest.importorskip("engine.layers.fused_kernels", reason="triton is not installed")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if ON_GPU else [torch.float32]


def close(a, b, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    torch.manual_seed(0)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden))
    x = torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    res = torch.randn_like(x)
    out, _ = fk.rms_norm(x, norm.weight, 1e-6)
    assert close(out, norm(x), dtype)
    for res_dtype in {dtype, torch.float32}:  # the decoder keeps its residual in fp32
        r = res.to(res_dtype)
        out2, new_res = fk.rms_norm(x, norm.weight, 1e-6, r)
        ref_out, ref_res = norm(x, r)
        assert new_res.dtype == res_dtype and out2.dtype == dtype
        assert torch.equal(new_res, ref_res)  # the sum is rounded exactly as torch does
        assert close(out2, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [128, 1536, 3000])
def test_silu_and_mul(dtype, inter):
    x = torch.randn(5, 2 * inter, device=DEVICE, dtype=dtype)
    assert close(fk.silu_and_mul(x), SiluAndMul()(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim, heads, kv_heads, qk_norm", [(64, 9, 3, False), (128, 16, 8, True)]
)
def test_rope_qk_in_place_matches_torch(dtype, head_dim, heads, kv_heads, qk_norm):
    torch.manual_seed(1)
    rope = RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0)).to(DEVICE)
    tokens = 11
    # q and k as views of one fused qkv tensor, like the model's.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 512, (tokens,), device=DEVICE)
    qn, kn = RMSNorm(head_dim).to(DEVICE, dtype), RMSNorm(head_dim).to(DEVICE, dtype)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.1 * torch.randn(head_dim))
        kn.weight.copy_(1 + 0.1 * torch.randn(head_dim))
    ref_q, ref_k = (qn(q), kn(k)) if qk_norm else (q.clone(), k.clone())
    ref_q, ref_k = rope(positions, ref_q, ref_k)
    fk.rope_qk_(
        q,
        k,
        positions,
        rope.cos_cache,
        rope.sin_cache,
        qn.weight if qk_norm else None,
        kn.weight if qk_norm else None,
        1e-6,
    )
    assert close(q, ref_q, dtype) and close(k, ref_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_qk_with_kv_store_writes_the_cache_like_the_backend(dtype, qk_norm):
    """The KV store folded into the RoPE launch: the cache afterwards holds exactly
    what RoPE then the backends' store write (padding rows, slot -1, write nothing)."""
    from engine.layers.attention.torch_backend import write_kv

    torch.manual_seed(2)
    heads, kv_heads, head_dim, tokens, block_size, num_blocks = 4, 2, 64, 9, 4, 6
    rope = RotaryEmbedding(head_dim, 128, RopeConfig(theta=10000.0)).to(DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 128, (tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[3] = -1  # a padding row
    weights = [1 + 0.1 * torch.randn(head_dim, device=DEVICE, dtype=dtype) for _ in range(2)]
    norms = weights if qk_norm else [None, None]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    ref_q, ref_k = q.clone(), k.clone()
    fk.rope_qk_(ref_q, ref_k, positions, rope.cos_cache, rope.sin_cache, *norms, 1e-6)
    ref_kc, ref_vc = (
        torch.zeros(shape, device=DEVICE, dtype=dtype),
        torch.zeros(shape, device=DEVICE, dtype=dtype),
    )
    keep = slots >= 0
    write_kv(ref_k[keep], v[keep], ref_kc, ref_vc, slots[keep])
    k_cache, v_cache = (
        torch.zeros(shape, device=DEVICE, dtype=dtype),
        torch.zeros(shape, device=DEVICE, dtype=dtype),
    )
    store = (v, k_cache, v_cache, slots)
    fk.rope_qk_(q, k, positions, rope.cos_cache, rope.sin_cache, *norms, 1e-6, kv_store=store)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)


@pytest.mark.parametrize("kind, backend", [("llama", "torch"), ("qwen3", "triton")])
def test_fused_decoder_matches_the_unfused_one(tiny_model, kind, backend):
    """The model with every fused kernel (norms, SiLU, RoPE + KV store in one launch)
    against the plain torch ops: prefill, then decode steps that read the KV the
    fused launch stored."""
    from tests.engine.test_models import PROMPT, make_runner, our_logits

    model_dir, _ = tiny_model(kind)
    # fp32 and the plain ops first on either device (on CUDA the engine would
    # fuse from the start); eager: the test calls the model itself.
    runner = make_runner(
        model_dir,
        device=DEVICE,
        dtype="float32",
        fused_ops=False,
        enforce_eager=True,
        attention_backend=backend,
    )
    chunks = [len(PROMPT) - 3, 1, 1, 1]
    plain = our_logits(runner, PROMPT, chunks)
    for module in runner.model.modules():
        if hasattr(module, "fused"):
            module.fused = True
    fused = our_logits(runner, PROMPT, chunks)
    assert torch.allclose(fused, plain, atol=1e-4, rtol=1e-4), (fused - plain).abs().max()
