"""The skinny GEMM on a GPU: the kernel against F.linear at the tuned models'
shapes, planning at load, and the engine with and without it.

Run on a GPU host: ``python -m pytest tests/gpu/test_skinny_gemm_cuda.py -m gpu``.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gemv_tuning import projection_shapes
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers.skinny_gemm import M_BUCKETS, MAX_M, default_config
from engine.layers.specs import GemvBackend
from engine.model_runner import ModelRunner
from tests.engine.test_models import our_logits

pytestmark = pytest.mark.gpu

SHAPES = sorted(
    set(projection_shapes("qwen3-0.6b").values()) | set(projection_shapes("llama-3.1-8b").values())
)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 13, 16])
def test_kernel_is_as_accurate_as_cublas(n, k, m):
    """Against an fp64 product of the same bf16 inputs, our error is cuBLAS's
    (both accumulate in fp32 and round once; only the summation order differs)."""
    from engine.layers.skinny_gemm_kernels import skinny_gemm

    torch.manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    exact = F.linear(x.double(), w.double(), b.double())
    cublas_err = (F.linear(x, w, b).double() - exact).abs().max().item()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = default_config(m, n, k, sms)
    for cfg in (default, dataclasses.replace(default, split_k=4)):
        ours = skinny_gemm(x, w, b, cfg)
        err = (ours.double() - exact).abs().max().item()
        assert err <= 1.5 * cublas_err + 1e-3, (cfg, err, cublas_err)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """Qwen3-0.6B's shape with 4 layers and HF's random init, in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.shapes import SHAPES as MODEL_SHAPES

    raw = {
        k: v
        for k, v in MODEL_SHAPES["qwen3-0.6b"].items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    raw["num_hidden_layers"] = 4
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("qwen3", **raw), dtype=torch.bfloat16
        )
    out = tmp_path_factory.mktemp("qwen3-4l")
    model.save_pretrained(out)
    del model
    return out


def runner_for(model_dir, backend: str) -> ModelRunner:
    config = EngineConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        num_kvcache_blocks=256,
        max_model_len=1024,
        device="cuda",
        gemv_backend=backend,
        enforce_eager=True,
    )
    return ModelRunner(config, frozenset())


def test_plans_cover_every_projection(qwen3_dir):
    forced = runner_for(qwen3_dir, "triton")
    assert set(forced.gemv_plans) == set(projection_shapes("qwen3-0.6b").values())
    assert all(p.config_for(m) is not None for p in forced.gemv_plans.values() for m in M_BUCKETS)
    layer = forced.model.layers[0]
    assert layer.mlp.gate_up_proj.gemv_plan is forced.gemv_plans[(6144, 1024)]
    assert forced.model.lm_head.__class__ is torch.nn.Linear  # the LM head stays cuBLAS's
    auto = runner_for(qwen3_dir, "auto")  # a table for this GPU, or measured now
    assert set(auto.gemv_plans) == set(forced.gemv_plans)
    off = runner_for(qwen3_dir, "torch")
    assert off.gemv_plans == {}
    assert off.model.layers[0].mlp.gate_up_proj.gemv_plan is None
    assert layer.mlp.gate_up_proj.gemv_plan is not None  # each model keeps its own plans


def test_decode_logits_with_the_kernel_match_cublas(qwen3_dir):
    """Teacher forcing through single-token decode steps (M = 1, the kernel's case):
    our logits and cuBLAS's differ by bf16 rounding only."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 150000, (96,), generator=gen).tolist()
    chunks = [64] + [1] * 32
    logits = {}
    for backend in ("torch", "triton"):
        runner = runner_for(qwen3_dir, backend)
        logits[backend] = our_logits(runner, ids, chunks).float()[64:]
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    a, b = logits["torch"], logits["triton"]
    cos = F.cosine_similarity(a, b, dim=-1).min().item()
    assert cos > 0.999, cos
    assert (a - b).abs().mean().item() < 2e-2 * a.abs().mean().item()


def test_greedy_output_with_and_without_the_kernel(qwen3_dir):
    """LLM.generate through the CUDA graphs (8 sequences, then fewer as they end):
    the same tokens with the kernel and without, except after a near-tie, where
    bf16 rounding may pick either of two almost equal tokens."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in range(20, 100, 10)]
    params = [
        SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(qwen3_dir),
            skip_tokenizer_init=True,
            max_model_len=1024,
            gpu_memory_utilization=0.3,
            max_num_seqs=MAX_M,
            gemv_backend=backend,
        )
        assert llm.llm_engine.config.gemv_backend is GemvBackend(backend)
        runs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    identical = 0
    for ref, ours in zip(runs["torch"], runs["triton"], strict=True):
        assert len(ref.token_ids) == len(ours.token_ids)
        # The first token comes from the prefill (many tokens: cuBLAS in both runs).
        assert ref.token_ids[0] == ours.token_ids[0]
        diverged = next(
            (
                i
                for i, (x, y) in enumerate(zip(ref.token_ids, ours.token_ids, strict=True))
                if x != y
            ),
            None,
        )
        if diverged is None:
            identical += 1
            continue
        # Same context up to here: both tokens were (near) the top of one distribution.
        top = sorted(ref.logprobs[diverged].values(), key=lambda lp: lp.rank or 99)[:2]
        gap = top[0].logprob - top[1].logprob
        assert gap < 0.1, (diverged, gap)
    print(f"{identical} of {len(prompts)} completions identical; the rest split at near-ties")
