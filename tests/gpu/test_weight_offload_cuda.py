"""Weights offload (cpu_offload_gb, engine/weight_offload.py) on a CUDA GPU: the
device holds fewer weight bytes, the KV pool gets the room, and greedy tokens
equal the plain engine's, with CUDA graphs (decode and piecewise, capturing
the copies from pinned memory) and without.

Run on a GPU host: ``python -m pytest tests/gpu -m gpu``. Skipped without CUDA.
"""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.device import GiB

pytestmark = pytest.mark.gpu

NUM_LAYERS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Llama of about 30 MB a layer (bf16), HF's random init, head dim 64."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("offload-llama")
    model.save_pretrained(out)
    return out


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    # Mixed steps (prefills beside decodes) of up to a few hundred tokens.
    return [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (5, 37, 200, 64, 301)]


def device_weight_bytes(llm: LLM) -> int:
    """Bytes of the model's distinct parameter storages on the GPU."""
    seen = {}
    for p in llm.llm_engine.model_runner.model.parameters():
        if p.is_cuda:
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def run(model_dir, eager: bool, cpu_offload_gb: float = 0) -> dict:
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=1024,
        max_num_batched_tokens=1024,
        max_num_seqs=8,
        gpu_memory_utilization=0.5,
        attention_backend="triton",  # the backend the piecewise graphs run with
        gemv_backend="torch",  # no timing-dependent kernel choice between the runs
        enforce_eager=eager,
        cpu_offload_gb=cpu_offload_gb,
    )
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts(), GREEDY)]
    runner = llm.llm_engine.model_runner
    facts = dict(
        tokens=tokens,
        weights=device_weight_bytes(llm),
        layer_bytes=sum(p.numel() * p.element_size() for p in runner.model.layers[-1].parameters()),
        blocks=runner.num_kvcache_blocks,
        block_bytes=runner.kv_block_bytes,
        layers=runner.offload.layer_indices if runner.offload is not None else [],
        graphs=runner.graphs is not None and runner.piecewise is not None,
    )
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return facts


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_offload_frees_device_memory_and_keeps_greedy_tokens(model_dir, eager):
    plain = run(model_dir, eager)
    layer_bytes = plain["layer_bytes"]
    half = NUM_LAYERS // 2
    off = run(model_dir, eager, (half + 0.5) * layer_bytes / GiB)
    assert off["layers"] == list(range(half))
    assert off["graphs"] == plain["graphs"] == (not eager)  # offloading keeps both kinds
    # The offloaded layers' bytes leave the device, but for one shared set of buffers.
    assert off["weights"] == plain["weights"] - (half - 1) * layer_bytes
    # The KV pool gets (most of) that room; allow for profiling noise.
    room = (half - 1) * layer_bytes / plain["block_bytes"]
    assert off["blocks"] > plain["blocks"] + 0.5 * room
    assert off["tokens"] == plain["tokens"]
