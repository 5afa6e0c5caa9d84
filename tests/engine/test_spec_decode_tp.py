"""Speculative decoding under tensor parallelism, on the CPU over gloo.

A tiny random Llama whose 12 heads and 6 KV heads split over 2 and 3 ranks:
n-gram proposals at TP = 2 give TP = 1's greedy tokens (without speculation,
and HF transformers') and seeded samples (with and without speculation), with
proposals kept; at TP = 3 under a pool small enough to preempt, still
transformers' tokens. A draft model sharded over the target's two ranks (each
rank runs its part of every draft forward, planned by rank 0), its catch-up
over the prompts cut to the step budget, gives TP = 1's greedy tokens and,
with its sampled proposals, TP = 1's seeded samples.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.conftest import build_tiny_hf_model, hf_greedy_ids
from tests.engine.conftest import assert_idle, perturbed_copy

# Splits over 2 ranks (3 KV heads each) and 3 (2 each); the vocabulary over
# 3 leaves the last shard padded.
SHAPE = dict(
    hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192,
    vocab_size=500,
)  # fmt: skip
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
}
# Prompts that repeat themselves, and a random model's greedy text loops: lookup pays.
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 3, 99, 5 + i, 17, 3, 40 + i]} for i in range(3)]
GREEDY = SamplingParams(
    temperature=0, max_tokens=32, ignore_eos=True, detokenize=False, logprobs=2
)  # fmt: skip


def make_llm(model_dir, tp: int = 1, spec: dict | None = None, **kwargs) -> LLM:
    options = dict(
        skip_tokenizer_init=True, device="cpu", max_model_len=512, seed=0, num_kvcache_blocks=64
    )  # fmt: skip
    options.update(kwargs)
    return LLM(str(model_dir), tensor_parallel_size=tp, speculative_config=spec, **options)


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def accepted(llm: LLM) -> int:
    return llm.llm_engine.stats().spec_decode.num_accepted_tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-12-heads")
    return out, build_tiny_hf_model("llama", out, overrides=SHAPE)


@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model[0])


@pytest.fixture(scope="module")
def spec1(model):
    return make_llm(model[0], spec=NGRAM)


@pytest.fixture(scope="module")
def spec2(model):
    llm = make_llm(model[0], tp=2, spec=NGRAM)
    yield llm
    llm.llm_engine.shutdown()


def test_tp2_ngram_greedy_equals_tp1_and_transformers_with_proposals_kept(model, plain, spec2):
    _, hf = model
    want = [hf_greedy_ids(hf, p["prompt_token_ids"], GREEDY.max_tokens) for p in PROMPTS]
    ref = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(ref) == want
    assert len({tuple(t) for t in want}) > 1  # not one degenerate answer
    before = accepted(spec2)
    got = spec2.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(got) == want
    assert accepted(spec2) - before > 10  # proposals were verified and kept
    for r, g in zip(ref, got, strict=True):
        for a, b in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) for t in a)
    assert_idle(spec2)


def test_tp2_ngram_seeded_samples_equal_tp1_with_and_without_speculation(plain, spec1, spec2):
    seeded = [
        SamplingParams(temperature=1.0, seed=11 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    # Sampled text repeats within four allowed tokens: proposals get kept.
    seeded[1] = seeded[1].clone(top_k=5, repetition_penalty=1.2)
    seeded[2] = seeded[2].clone(allowed_token_ids=[7, 19, 23, 42])
    before = accepted(spec2)
    got = tokens(spec2.generate(PROMPTS, seeded, use_tqdm=False))
    assert got == tokens(spec1.generate(PROMPTS, seeded, use_tqdm=False))
    assert got == tokens(plain.generate(PROMPTS, seeded, use_tqdm=False))
    assert accepted(spec2) > before
    assert_idle(spec2)


def test_tp3_ngram_under_preemption_equals_tp1_and_transformers(model, plain):
    # Six sequences of up to 48 tokens need 18 blocks of 16; the pool has 10.
    _, hf = model
    prompts = PROMPTS + [{"prompt_token_ids": [60 + i, 2, 60 + i, 2, 9]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
    want = [hf_greedy_ids(hf, p["prompt_token_ids"], params.max_tokens) for p in prompts]
    small = make_llm(model[0], tp=3, spec=NGRAM, max_model_len=128, num_kvcache_blocks=10)
    try:
        got = small.generate(prompts, params, use_tqdm=False)
        stats = small.llm_engine.stats()
        assert stats.num_preemptions > 0
        assert stats.spec_decode.num_accepted_tokens > 0
        assert tokens(got) == tokens(plain.generate(prompts, params, use_tqdm=False))
        # Transformers stops at its EOS; this engine ignores it (the pressure).
        assert [g[: len(w)] for g, w in zip(tokens(got), want, strict=True)] == want
        # Seeded samples too: a preempted sequence's generator goes on where it was.
        seeded = [params.clone(temperature=1.0, seed=3 + i, top_k=4) for i in range(len(prompts))]
        preempted = small.llm_engine.stats().num_preemptions
        got = tokens(small.generate(prompts, seeded, use_tqdm=False))
        assert small.llm_engine.stats().num_preemptions > preempted
        assert got == tokens(plain.generate(prompts, seeded, use_tqdm=False))
        assert_idle(small)
    finally:
        small.llm_engine.shutdown()


@pytest.fixture(scope="module")
def perturbed(model, tmp_path_factory):
    """The model with noise on its MLPs: a draft that mostly agrees."""
    return perturbed_copy(model[0], tmp_path_factory.mktemp("perturbed-12-heads"))


def test_tp2_draft_model_equals_tp1_greedy_and_seeded(model, perturbed, plain):
    draft = {"method": "draft_model", "model": str(perturbed), "num_speculative_tokens": 3}
    # The draft's first forward for a sequence catches up over its whole
    # prompt: 460 tokens here, more than the hand-off channel of a 16-token
    # step budget holds, so it runs as several forwards of the budget.
    prompts = PROMPTS + [{"prompt_token_ids": [(7 * i) % 97 for i in range(460)]}]
    budget = dict(max_num_batched_tokens=16, max_num_seqs=4)
    one = make_llm(model[0], spec=draft, **budget)
    two = make_llm(model[0], tp=2, spec=draft, **budget)
    try:
        greedy = GREEDY.clone(logprobs=None)
        want = tokens(plain.generate(prompts, greedy, use_tqdm=False))
        assert tokens(two.generate(prompts, greedy, use_tqdm=False)) == want
        stats = two.llm_engine.stats().spec_decode
        assert 0.0 < stats.acceptance_rate < 1.0  # some kept, some rejected
        seeded = [
            SamplingParams(temperature=1.0, seed=5 + i, max_tokens=16, ignore_eos=True)
            for i in range(len(PROMPTS))
        ]
        got = tokens(two.generate(PROMPTS, seeded, use_tqdm=False))
        assert got == tokens(one.generate(PROMPTS, seeded, use_tqdm=False))
        assert len({tuple(t) for t in got}) > 1
        assert_idle(two)
    finally:
        two.llm_engine.shutdown()
