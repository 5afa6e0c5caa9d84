"""FP8 weights on a CUDA GPU: ``torch._scaled_mm`` against the dequantized
reference, the demo model's agreement with bf16 (CUDA graphs on), and
tensor parallelism over two GPUs (``multi_gpu``).

Run on a GPU host of compute capability >= 8.9: ``python -m pytest
tests/gpu/test_fp8_cuda.py -m gpu``. Skipped without CUDA (and without FP8).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.quantization.fp8 import (
    Fp8Linear,
    fp8_gemm,
    fp8_gemm_reference,
    quantize_rows,
)
from tests.conftest import needs_demo_model
from tests.engine.test_fp8_weights import (
    PROMPT,
    TEXT,
    perplexity,
    teacher_forced,
    write_prequantized,
)
from tests.engine.test_fp8_weights import tiny_dir as tiny_dir

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_fp8():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMM needs compute capability >= 8.9")


@pytest.mark.parametrize("m", [1, 3, 16, 77, 512])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (3072, 576), (576, 1536)])
def test_scaled_mm_matches_the_dequantized_reference(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = quantize_rows(torch.randn(n, k, device="cuda", generator=gen) * 0.05)
    q = quantize_rows(x)
    got = fp8_gemm(q, w.data, w.scale, torch.bfloat16)
    ref = fp8_gemm_reference(q, w.data, w.scale, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # The same FP8 products in fp32; the output rounded once to bf16.
    torch.testing.assert_close(got.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_fp8_linear_on_cuda_with_bias_and_leading_dims():
    from engine.device import default_dtype

    torch.manual_seed(0)
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        layer = Fp8Linear(256, 128, bias=True)
        w = torch.randn(128, 256) * 0.05
        rows = quantize_rows(w)
        layer.weight.data.copy_(rows.data)
        layer.weight_scale.copy_(rows.scale)
        layer.bias.data.copy_(torch.randn(128))
        x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.bias.dtype == torch.bfloat16
    y = layer(x)
    ref = x.float() @ w.float().t() + layer.bias.float()
    assert y.shape == (2, 5, 128)
    torch.testing.assert_close(y.float(), ref, rtol=0.1, atol=0.1)


@needs_demo_model
def test_demo_model_fp8_agrees_with_bf16_on_cuda_and_graphs_decode_alike(
    demo_model_dir, demo_tokenizer
):
    ids = demo_tokenizer.encode(TEXT)
    kw = dict(max_model_len=1024, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 30)
    bf16 = LLM(str(demo_model_dir), **kw)
    ref_top, ref_lp = teacher_forced(bf16, ids)
    bf16.llm_engine.shutdown()
    fp8 = LLM(str(demo_model_dir), quantization="fp8", **kw)
    assert fp8.llm_engine.model_runner.graphs is not None  # decode runs CUDA graphs
    top, lp = teacher_forced(fp8, ids)
    agree = sum(a == b for a, b in zip(top, ref_top, strict=True)) / len(top)
    print(f"\nCUDA FP8 weights: top-1 agreement {agree:.4f}; perplexity bf16 "
          f"{perplexity(ref_lp):.3f}, fp8 {perplexity(lp):.3f}")  # fmt: skip
    assert agree >= 0.97
    # Greedy decode through the graphs equals the eager decode of the same weights.
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (5, 17, 40)]
    graphed = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    fp8.llm_engine.shutdown()
    eager = LLM(str(demo_model_dir), quantization="fp8", enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.llm_engine.shutdown()
    assert graphed == want


@pytest.mark.multi_gpu
@pytest.mark.parametrize("fmt", ["online", "fp8-block"])
def test_tp2_fp8_stays_within_fp8_noise_of_tp1(tiny_dir, tmp_path, fmt):
    path = tiny_dir if fmt == "online" else write_prequantized(tiny_dir, tmp_path / fmt, fmt)
    kw = dict(device="cuda", skip_tokenizer_init=True, max_model_len=256, dtype="bfloat16",
              kv_cache_memory_bytes=1 << 30)  # fmt: skip
    if fmt == "online":
        kw["quantization"] = "fp8"
    lps = []
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, **kw)
        lps.append(torch.tensor(teacher_forced(llm, PROMPT)[1]))
        llm.llm_engine.shutdown()
    # Each rank scales its own share of the row-parallel inputs: FP8 noise, not equality.
    assert (lps[1] - lps[0]).abs().max().item() < 0.3
