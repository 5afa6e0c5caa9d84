"""FP8 KV cache on a tiny random Llama (CPU): options, block count, checkpoint
scales, and the torch backend's FP8 path against a dequantized reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers.attention import AttentionBackendName, TorchAttention, select_backend
from engine.layers.attention.backend import AttentionMetadata
from engine.layers.attention.kv_quant import FP8_KV_DTYPE, dequantize, quantize


@pytest.fixture(scope="module")
def llama_dir(tiny_llama_dir):
    return tiny_llama_dir


def _llm(model_dir, **kw) -> LLM:
    return LLM(
        str(model_dir),
        max_model_len=128,
        device="cpu",
        kvcache_block_size=16,
        skip_tokenizer_init=True,
        **kw,
    )


def test_an_unknown_kv_cache_dtype_lists_the_supported_ones(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3'"):
        EngineConfig(str(llama_dir), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="calculate_kv_scales must be True or False"):
        EngineConfig(str(llama_dir), calculate_kv_scales="yes")
    # A backend that cannot read FP8 KV is refused by name (auto skips it).
    with pytest.raises(ValueError, match="does not read an FP8 KV cache"):
        select_backend(
            AttentionBackendName.FLASH_ATTN, torch.device("cpu"), torch.float32, fp8_kv=True
        )


def test_the_block_pool_doubles_at_equal_memory(llama_dir):
    budget = 8 << 20
    bf16 = _llm(llama_dir, dtype="bfloat16", kv_cache_memory_bytes=budget)
    fp8 = _llm(llama_dir, dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    b, f = bf16.llm_engine.model_runner, fp8.llm_engine.model_runner
    assert f.kv_block_bytes * 2 == b.kv_block_bytes
    assert f.num_kvcache_blocks == 2 * b.num_kvcache_blocks
    assert f.kv_cache.dtype == FP8_KV_DTYPE and b.kv_cache.dtype == torch.bfloat16
    nbytes = [c.kv_cache.numel() * c.kv_cache.element_size() for c in (b, f)]
    assert nbytes[0] == nbytes[1] <= budget  # the same memory


def _with_scales(src, dst, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "kv_scales.safetensors"))
    return dst


def test_checkpoint_scales_are_read_and_misshaped_ones_named(llama_dir, tmp_path):
    good = _with_scales(
        llama_dir,
        tmp_path / "good",
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.05),
            "model.layers.1.self_attn.v_scale": torch.tensor([0.25]),
        },
    )
    llm = _llm(good, kv_cache_dtype="fp8")
    scales = llm.llm_engine.model_runner.kv_scales
    assert scales[0].tolist() == pytest.approx([0.05, 1.0])
    assert scales[1].tolist() == [1.0, 0.25]  # absent: vLLM's default 1.0
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    bad = _with_scales(
        llama_dir, tmp_path / "bad", {"model.layers.1.self_attn.k_scale": torch.ones(4)}
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_scale has shape \(4,\)"):
        _llm(bad, kv_cache_dtype="fp8")


def test_calculate_kv_scales_sets_each_layers_scales_from_the_first_prompt(llama_dir):
    llm = _llm(llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = llm.llm_engine.model_runner
    assert torch.all(runner.kv_scales == 1.0)
    llm.generate([[3, 1, 4, 1, 5, 9, 2, 6]], SamplingParams(temperature=0, max_tokens=2))
    assert torch.all(runner.kv_scales != 1.0) and torch.all(runner.kv_scales > 0)
    assert not any(a.scales_pending for a in runner.model.attention_layers)


def _meta(query_lens, seq_lens, block_size, tables) -> AttentionMetadata:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(s - q, s):
            slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(
        num_seqs=len(query_lens),
        num_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )


@pytest.mark.parametrize("query_lens", [[5, 9], [1, 1]], ids=["prefill", "decode"])
def test_torch_backend_reads_fp8_as_its_dequantized_values(query_lens):
    """Writing into an FP8 cache then attending equals attending over a cache in
    the model's dtype that holds the dequantized values (the same numbers)."""
    torch.manual_seed(0)
    bs, heads, kv_heads, dim, blocks = 4, 4, 2, 16, 12
    seq_lens = [9, 11]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    scales = torch.tensor([0.02, 0.01])
    backend = TorchAttention(heads, kv_heads, dim, dim**-0.5, bs)
    fp8_k = torch.zeros(blocks, bs, kv_heads, dim, dtype=FP8_KV_DTYPE)
    fp8_v = fp8_k.clone()
    # Earlier tokens already in the cache (a prefix, or a decode's context).
    prior = _meta(
        [s - q for s, q in zip(seq_lens, query_lens, strict=True)],
        [s - q for s, q in zip(seq_lens, query_lens, strict=True)],
        bs,
        tables,
    )
    pk = torch.randn(prior.num_tokens, kv_heads, dim)
    pv = torch.randn(prior.num_tokens, kv_heads, dim)
    meta = _meta(query_lens, seq_lens, bs, tables)
    q = torch.randn(meta.num_tokens, heads, dim)
    k = torch.randn(meta.num_tokens, kv_heads, dim)
    v = torch.randn(meta.num_tokens, kv_heads, dim)
    from engine.layers.attention.torch_backend import write_kv

    write_kv(pk, pv, fp8_k, fp8_v, prior.slot_mapping, scales)
    out = backend.forward(q, k, v, fp8_k, fp8_v, meta, kv_scales=scales)
    ref_k = dequantize(fp8_k, scales[0], torch.float32)
    ref_v = dequantize(fp8_v, scales[1], torch.float32)
    want = backend.forward(q, k, v, ref_k, ref_v, meta, kv_stored=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # The new tokens were stored quantized by the layer's scales.
    idx = meta.slot_mapping
    got_k = fp8_k.view(-1, kv_heads, dim)[idx].to(torch.float32)
    assert torch.equal(got_k, quantize(k, scales[0]).to(torch.float32))
