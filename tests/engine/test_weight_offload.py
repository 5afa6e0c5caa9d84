"""Weights offload (cpu_offload_gb, engine/weight_offload.py) on the CPU, where
"host" and "device" memory are both CPU memory but the same path runs: layers
adopted into host copies, loaded into shared buffers, copied in before each
forward. Tiny random models (tests/conftest.py's ``tiny_model``): greedy tokens
with some layers offloaded equal the plain engine's and HF transformers'."""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams
from engine.device import GiB
from tests.conftest import hf_greedy_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 3, 7], [4, 100, 200, 300, 17, 8, 9, 10, 11, 12, 13], [42, 7]]


def make_llm(model_dir, **kwargs) -> LLM:
    return LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
        kvcache_block_size=8,
        num_kvcache_blocks=64,
        max_model_len=128,
        **kwargs,
    )


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def layer_bytes(llm: LLM, i: int) -> int:
    layer = llm.llm_engine.model_runner.model.layers[i]
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def storage(layer) -> set[int]:
    return {p.data_ptr() for p in layer.parameters()}


def test_offloaded_layer_streams_and_greedy_tokens_are_unchanged(tiny_model):
    model_dir, hf = tiny_model("llama")  # two layers
    plain = make_llm(model_dir)
    expected = greedy(plain)
    one_layer = layer_bytes(plain, 0)
    llm = make_llm(model_dir, cpu_offload_gb=1.5 * one_layer / GiB)
    runner = llm.llm_engine.model_runner
    offload = runner.offload
    assert offload.layer_indices == [0]  # the first layer fits, the second would not
    assert llm.llm_engine.stats().offloaded_weight_bytes == one_layer
    # Layer 0 runs from device buffers, its weights kept in separate host copies.
    host = {t.data_ptr() for t in offload._layers[0].host}
    assert storage(runner.model.layers[0]).isdisjoint(host)
    assert greedy(llm) == expected
    assert offload.num_layer_loads > 0
    for ids, got in zip(PROMPTS, expected, strict=True):
        ref = hf_greedy_ids(hf, ids, GREEDY.max_tokens)  # HF stops at an EOS; we ignore it
        assert ref and got[: len(ref)] == ref


def test_layers_of_one_shape_share_buffers_and_each_loads_its_own(tiny_model):
    """Gemma3's three layers: the first two offloaded into one set of buffers.
    Were a layer not copied in before it runs, it would run with the other's
    weights and the tokens would change."""
    model_dir, _ = tiny_model("gemma3")
    plain = make_llm(model_dir)
    expected = greedy(plain)
    budget = layer_bytes(plain, 0) + layer_bytes(plain, 1) + layer_bytes(plain, 2) // 2
    llm = make_llm(model_dir, cpu_offload_gb=budget / GiB)
    runner = llm.llm_engine.model_runner
    assert runner.offload.layer_indices == [0, 1]
    layers = runner.model.layers
    assert storage(layers[0]) == storage(layers[1])
    assert storage(layers[0]).isdisjoint(storage(layers[2]))
    assert greedy(llm) == expected
    # Every step loads both offloaded layers.
    assert runner.offload.num_layer_loads % 2 == 0 and runner.offload.num_layer_loads >= 2


@pytest.mark.parametrize("bad", [-1, "2", True, math.nan, math.inf])
def test_bad_cpu_offload_gb_is_refused(tiny_llama_dir, bad):
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        make_llm(tiny_llama_dir, cpu_offload_gb=bad)
