"""FP8 KV cache on CUDA: the Triton kernels read FP8 entries directly (scaled in
registers) and must equal attention over the dequantized cache; the store
kernel quantizes as the torch path does; the engine agrees with bf16 KV
end to end, teacher-forced, on the demo model.

Run on a GPU host: ``python -m pytest tests/gpu/test_fp8_kv_cuda.py -m gpu``.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.layers.attention.kv_quant import FP8_KV_DTYPE, dequantize, quantize
from tests.conftest import DEMO_MODEL_DIR, needs_demo_model, perplexity, teacher_forced
from tests.kernels.test_triton_kernels import random_layout, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCALES = (0.03, 0.015)  # [k_scale, v_scale]: values of a few units map well inside e4m3


def fp8_caches(num_blocks, block_size, kv_heads, head_dim):
    """An FP8 K and V cache of random values, and their dequantized bf16 twins."""
    scales = torch.tensor(SCALES, device="cuda")
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = quantize(3 * torch.randn(shape, device="cuda"), scales[0])
    v = quantize(3 * torch.randn(shape, device="cuda"), scales[1])
    ref_k = dequantize(k, scales[0], torch.bfloat16)
    ref_v = dequantize(v, scales[1], torch.bfloat16)
    return scales, k, v, ref_k, ref_v


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize(
    "q_lens, prefix_lens, heads, kv_heads, head_dim, block_size",
    [([5, 17, 1], [0, 23, 40], 4, 2, 64, 16), ([130, 3], [0, 300], 8, 2, 128, 32)],
)
def test_prefill_kernels_read_fp8_kv(
    q_lens, prefix_lens, heads, kv_heads, head_dim, block_size, num_splits
):
    from engine.layers.attention import triton_kernels as tk
    from engine.layers.attention import triton_prefill_split as ts

    rng = random.Random(0)
    torch.manual_seed(0)
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    scales, k, v, ref_k, ref_v = fp8_caches(num_blocks, block_size, kv_heads, head_dim)
    bt = random_layout(rng, q_lens, prefix_lens, block_size, num_blocks)
    q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qsl = qsl.cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    ws = (
        ts.make_workspace(q.shape[0], heads, head_dim, num_splits, q.device)
        if num_splits > 1
        else None
    )
    out = torch.empty_like(q)
    tk.prefill_attention(
        q, k, v, out, bt, qsl, lens, max(q_lens), head_dim**-0.5,
        num_splits=num_splits, workspace=ws, kv_scales=scales,
    )  # fmt: skip
    want = torch.empty_like(q)
    tk.prefill_attention(
        q, ref_k, ref_v, want, bt, qsl, lens, max(q_lens), head_dim**-0.5,
        num_splits=num_splits, workspace=ws,
    )  # fmt: skip
    # The same bf16 operands reach the tensor cores: equal up to accumulation order.
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    ref = reference(q, ref_k, ref_v, bt, q_lens, seq_lens, heads, kv_heads, head_dim)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("seq_lens, heads, kv_heads, head_dim, block_size", [
    ([1, 37, 300, 1024], 8, 2, 128, 16), ([5, 77], 4, 4, 64, 64),
])  # fmt: skip
def test_decode_kernel_reads_fp8_kv(seq_lens, heads, kv_heads, head_dim, block_size, num_splits):
    from engine.layers.attention import triton_decode as td

    rng = random.Random(1)
    torch.manual_seed(1)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    scales, k, v, ref_k, ref_v = fp8_caches(num_blocks, block_size, kv_heads, head_dim)
    bt = random_layout(rng, [1] * len(seq_lens), [s - 1 for s in seq_lens], block_size, num_blocks)
    q = torch.randn(len(seq_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    td.decode_attention(q, k, v, out, bt, lens, head_dim**-0.5, num_splits, kv_scales=scales)
    ref = reference(q, ref_k, ref_v, bt, [1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_store_kernel_quantizes_as_the_torch_path():
    from engine.layers.attention import triton_kernels as tk
    from engine.layers.attention.torch_backend import write_kv

    torch.manual_seed(2)
    k = 20 * torch.randn(6, 2, 64, device="cuda", dtype=torch.bfloat16)  # some past 448 x scale
    v = torch.randn_like(k)
    scales = torch.tensor(SCALES, device="cuda")
    slots = torch.tensor([5, 17, -1, 127, 3, 64], device="cuda")
    caches = [torch.zeros(8, 16, 2, 64, device="cuda", dtype=FP8_KV_DTYPE) for _ in range(4)]
    tk.store_kv(k, v, caches[0], caches[1], slots, scales)
    keep = slots >= 0
    write_kv(k[keep], v[keep], caches[2], caches[3], slots[keep], scales)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.isnan(caches[0].float()).any()  # saturated, not NaN


@needs_demo_model
def test_engine_fp8_kv_agrees_with_bf16_on_cuda():
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams
    from tests.engine.test_disaggregation import TEXT

    ids = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).encode(TEXT)
    results = {}
    for kv in ("auto", "fp8"):
        llm = LLM(
            str(DEMO_MODEL_DIR),
            max_model_len=1024,
            attention_backend="triton",
            kv_cache_dtype=kv,
            gpu_memory_utilization=0.3,
        )
        runner = llm.llm_engine.model_runner
        assert runner.kv_cache.dtype == (FP8_KV_DTYPE if kv == "fp8" else torch.bfloat16)
        top, lp = teacher_forced(llm, ids)
        ppl = perplexity(lp)
        # Decode steps (CUDA graphs) too: greedy continuation of a prompt.
        (gen,) = llm.generate(
            [{"prompt_token_ids": ids[:60]}], SamplingParams(temperature=0, max_tokens=32)
        )
        results[kv] = (top, ppl, gen.outputs[0].token_ids, runner.num_kvcache_blocks)
        del llm
        torch.cuda.empty_cache()
    (ref_top, ref_ppl, ref_gen, ref_blocks), (top, ppl, gen, blocks) = results.values()
    agree = sum(a == b for a, b in zip(ref_top, top, strict=True)) / len(ref_top)
    print(f"\nCUDA FP8 KV: agreement {agree:.4f}, perplexity {ref_ppl:.4f} -> {ppl:.4f}")
    # On a CPU, bf16 weights: 95.4% of 153 positions agree between bf16 and FP8
    # KV (fp32 weights: 97.4%); issue 52's 98% is not reached by per-tensor
    # e4m3 on this 135M model (docs/engine.md, "FP8 KV cache").
    assert agree >= 0.94
    assert abs(ppl / ref_ppl - 1) < 0.05
    assert sum(a == b for a, b in zip(ref_gen, gen, strict=True)) >= 16  # same start
    assert blocks > 1.8 * ref_blocks  # about twice the blocks in the same budget
