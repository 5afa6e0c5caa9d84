"""After start-up, serving compiles no new attention kernel variant
(engine/kernel_warmup.py, engine/layers/attention/triton_jit.py).

A variant compiled under load stalls the step it lands in for 0.5-1 s
(docs/lab/2026-11-25-stalls-under-load.md). Run on a GPU host: ``python -m pytest tests/gpu -m gpu``.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.attention import triton_decode, triton_kernels, triton_prefill_split
from engine.models.shapes import write_shape_dir

pytestmark = pytest.mark.gpu

KERNELS = {
    "store_kv": triton_kernels._store_kv_kernel,
    "prefill": triton_kernels._prefill_kernel,
    "decode_split": triton_decode._decode_split_kernel,
    "decode_reduce": triton_decode._decode_reduce_kernel,
    "prefill_split": triton_prefill_split._prefill_split_kernel,
    "prefill_merge": triton_prefill_split._prefill_merge_kernel,
}


def variants() -> dict[str, int]:
    """Compiled variants of each kernel held in memory (Triton's per-device caches)."""
    return {
        name: sum(len(entry[0]) for entry in fn.device_caches.values())
        for name, fn in KERNELS.items()
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_shape_dir("qwen3-0.6b", str(tmp_path_factory.mktemp("shape")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_compiles_no_attention_variant_after_start_up(model_dir):
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        attention_backend="triton",
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
    )
    at_start = variants()
    assert at_start["prefill"] >= 2 and at_start["decode_split"] >= 1, at_start
    rng = random.Random(0)
    system = [rng.randrange(10, 20000) for _ in range(1500)]
    engine = llm.llm_engine
    # Arrivals all along: fresh prompts of every size, questions after a cached
    # system prompt, so steps mix decodes, chunks, short and split prefills.
    for i in range(96):
        n = rng.choice([3, 9, 16, 31, 33, 64, 100, 257, 700, 1500])
        prompt = (system if i % 3 == 0 else []) + [rng.randrange(10, 20000) for _ in range(n)]
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=rng.choice([1, 4, 24]), ignore_eos=True),
        )
        for _ in range(rng.choice([0, 1, 2])):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert variants() == at_start
