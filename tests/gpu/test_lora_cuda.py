"""Multi-LoRA on a GPU: the engine's mixed-adapter batches (Triton shrink /
expand) against HF + PEFT, and CUDA graphs replaying decode steps that mix
adapters against eager steps (the kernels alone: tests/kernels/test_lora_kernels.py).

Run on a GPU host: ``python -m pytest tests/gpu/test_lora_cuda.py -m gpu``.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import hf_greedy_ids
from tests.engine.test_lora import _prompts, make_lora_setup

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    return make_lora_setup(tiny_model, tmp_path_factory)


def _mixed(setup, **kwargs):
    model_dir, _, adapters = setup
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=256,
              skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8, max_loras=3,
              num_kvcache_blocks=128, **kwargs)  # fmt: skip
    loras = [None] + [r for r, _ in adapters]
    prompts = _prompts(8)
    per_prompt = [loras[i % 4] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    return llm, prompts, llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)


def test_engine_on_cuda_equals_hf_peft(lora_setup):
    _, hf_base, adapters = lora_setup
    oracles = [hf_base] + [m for _, m in adapters]
    llm, prompts, outs = _mixed(lora_setup, attention_backend="torch")
    assert llm.llm_engine.model_runner.lora.use_triton
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        want = hf_greedy_ids(oracles[i % 4], prompt, 8)
        assert out.outputs[0].token_ids == want, f"prompt {i}"


def test_cuda_graphs_replay_decode_steps_that_mix_adapters(lora_setup):
    eager, _, want = _mixed(lora_setup, attention_backend="triton", enforce_eager=True,
                            piecewise_cuda_graphs=False)  # fmt: skip
    del eager
    llm, _, got = _mixed(lora_setup, attention_backend="triton")
    runner = llm.llm_engine.model_runner
    assert runner.graphs is not None and runner.lora.in_graphs
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda inputs: calls.append(1) or run(inputs)
    _, _, again = _mixed_again(llm, lora_setup)
    assert calls, "no decode step replayed a graph"
    for w, g, a in zip(want, got, again, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert a.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            tok = next(iter(lw))
            assert lg[tok].logprob == pytest.approx(lw[tok].logprob, abs=1e-3)


def _mixed_again(llm, setup):
    _, _, adapters = setup
    loras = [None] + [r for r, _ in adapters]
    prompts = _prompts(8)
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    per_prompt = [loras[i % 4] for i in range(8)]
    return llm, prompts, llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)


def test_removed_adapters_free_their_slots_and_graphs_stay_exact(lora_setup):
    """On CUDA with graphs: after remove_lora of every adapter (their slots
    freed) and a re-add, the same mixed batch replays to the same tokens; an
    adapter re-added takes a freed slot and is copied in again."""
    llm, _, want = _mixed(lora_setup, attention_backend="triton")
    engine = llm.llm_engine
    lora, slots = engine.model_runner.lora, engine.scheduler.lora_slots
    loads = lora.num_slot_loads
    _, _, adapters = lora_setup
    for request, _ in adapters:
        assert engine.remove_lora(request.lora_int_id)
    assert slots.resident == {} and not lora.host and engine.list_loras() == set()
    for request, _ in adapters:
        assert engine.add_lora(request, lora.read(request))
    _, _, again = _mixed_again(llm, lora_setup)
    assert lora.num_slot_loads == loads + len(adapters)
    for w, a in zip(want, again, strict=True):
        assert a.outputs[0].token_ids == w.outputs[0].token_ids
