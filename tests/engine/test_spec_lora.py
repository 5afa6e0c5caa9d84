"""Speculative decoding with LoRA adapters, against HF transformers + PEFT.

A verifying sequence runs ``1 + k`` query positions in one step, and every
one of them must go through its adapter's products: a position that ran the
base model would decide which proposed tokens are kept from the wrong
logits. So a batch mixing three random PEFT adapters and the base model,
speculating by prompt lookup, must give per prompt exactly HF + PEFT's greedy
tokens and logprobs, and the same outputs as the batch without speculation,
with proposals kept for every adapter's sequences (otherwise no verify row
was checked). Seeded sampling at temperature 1 equals the run without
speculation too. A draft model proposes without the adapter (a proposal is
only a proposal: the adapted target verifies it), so its outputs are exact
as well.
"""

from __future__ import annotations

from collections import Counter

import pytest

from engine import LLM, SamplingParams
from engine.spec_decode.speculator import num_accepted
from tests.conftest import hf_greedy_ids
from tests.engine.conftest import assert_idle
from tests.engine.test_lora import _hf_logprobs, make_lora_setup  # skips without peft
from tests.engine.test_spec_decode import completions

NEW_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 2}  # fmt: skip


def _prompts() -> list[list[int]]:
    """Two self-repeating prompts per model (base + 3 adapters), interleaved so
    every step mixes all four: a random model's greedy text soon loops, and
    prompt lookup pays on it."""
    return [[5 + i, 17, 3, 99, 41 + i, 5 + i, 17, 3, 99, 41 + i, 5 + i, 17] for i in range(8)]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    model_dir, hf_base, adapters = make_lora_setup(tiny_model, tmp_path_factory)
    oracles = [hf_base] + [m for _, m in adapters]
    loras = [None] + [r for r, _ in adapters]
    return model_dir, oracles, loras


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256, seed=0,
               skip_tokenizer_init=True, enable_lora=True, max_loras=3, max_lora_rank=8,
               num_kvcache_blocks=128, **kwargs)  # fmt: skip


@pytest.fixture(scope="module")
def pair(setup):
    model_dir = setup[0]
    return _llm(model_dir), _llm(model_dir, speculative_config=SPEC)


def _count_accepted(llm) -> Counter:
    """Wrap the speculator's ``accept``: proposed tokens kept, per adapter id
    (0: the base model)."""
    speculator = llm.llm_engine.speculator
    accept = speculator.accept
    kept: Counter = Counter()

    def counting(seq, drafts, samples, logprobs, first, emit):
        lora = seq.lora_request
        kept[lora.lora_int_id if lora else 0] += num_accepted(drafts, samples, first)
        return accept(seq, drafts, samples, logprobs, first, emit)

    speculator.accept = counting
    return kept


def test_mixed_adapter_batch_greedy_equals_hf_peft_and_non_speculative(setup, pair):
    _, oracles, loras = setup
    plain, spec = pair
    prompts = _prompts()
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    kept = _count_accepted(spec)
    try:
        got = spec.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    finally:
        del spec.llm_engine.speculator.accept  # back to the class's method
    want = plain.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    assert completions(got) == completions(want)
    outputs: dict[int, set] = {}
    for i, (prompt, out) in enumerate(zip(prompts, got, strict=True)):
        oracle = oracles[i % len(oracles)]
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy_ids(oracle, prompt, NEW_TOKENS), f"prompt {i}"
        got_lp = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        assert got_lp == pytest.approx(_hf_logprobs(oracle, prompt, tokens), abs=2e-4)
        outputs.setdefault(i % len(oracles), set()).add(tuple(tokens))
    # The adapters change the outputs, or this would prove nothing.
    assert len({frozenset(v) for v in outputs.values()}) == len(oracles)
    # Every adapter's (and the base's) verify rows kept proposed tokens.
    assert set(kept) == {0, 1, 2, 3} and all(n > 0 for n in kept.values()), kept
    assert_idle(spec)


def test_mixed_adapter_batch_seeded_sampling_equals_non_speculative(setup, pair):
    _, _, loras = setup
    plain, spec = pair
    prompts = _prompts()
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    params = [
        SamplingParams(temperature=1.0, seed=31 + i, max_tokens=16, ignore_eos=True, top_k=3)
        for i in range(len(prompts))
    ]
    before = spec.llm_engine.stats().spec_decode.num_accepted_tokens
    got = spec.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    assert completions(got) == completions(
        plain.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    )
    assert spec.llm_engine.stats().spec_decode.num_accepted_tokens > before
    assert_idle(spec)


def test_a_draft_model_proposes_without_the_adapter_and_outputs_stay_exact(setup):
    """The base model drafting for itself: its proposals are the adapted
    target's only where the adapter does not change the choice, so some are
    kept and some rejected, and the output is HF + PEFT's either way."""
    model_dir, oracles, loras = setup
    draft = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    llm = _llm(model_dir, speculative_config=draft)
    prompts = _prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    for i, (prompt, out) in enumerate(zip(prompts, got, strict=True)):
        assert out.outputs[0].token_ids == hf_greedy_ids(oracles[i], prompt, NEW_TOKENS), i
    stats = llm.llm_engine.stats().spec_decode
    assert 0.0 < stats.acceptance_rate < 1.0, stats
    assert_idle(llm)
