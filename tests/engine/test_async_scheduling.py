"""Async scheduling on the CPU: the same code path as on CUDA (the device gather of
the last step's samples, placeholders, stops applied one step late), compared
with the synchronous engine (``demo_llm``: async scheduling is off on a CPU by
default). The GPU variants are in tests/gpu/test_async_scheduling_cuda.py."""

from __future__ import annotations

import pytest

from engine import LLM, RequestOutputKind, SamplingParams
from engine.sequence import PLACEHOLDER
from tests.engine.conftest import assert_idle
from tests.engine.test_disaggregation import disaggregated

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def async_llm(demo_model_dir):
    llm = LLM(str(demo_model_dir), max_model_len=1024, device="cpu", async_scheduling=True)
    assert llm.llm_engine.async_scheduling
    return llm


def ids_and_reasons(outs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs
    ]


def test_default_is_synchronous_on_cpu(demo_llm):
    assert not demo_llm.llm_engine.async_scheduling


def test_greedy_seeded_n_and_logprobs_match_sync(demo_llm, async_llm):
    params = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=9, n=2),
        SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=7, repetition_penalty=1.3),
    ]
    sync = demo_llm.generate(PROMPTS, params)
    got = async_llm.generate(PROMPTS, params)
    assert ids_and_reasons(got) == ids_and_reasons(sync)
    for s, a in zip(sync[2].outputs[0].logprobs, got[2].outputs[0].logprobs, strict=True):
        assert s.keys() == a.keys()
        assert all(abs(s[k].logprob - a[k].logprob) < 1e-4 for k in s)
    assert got[2].prompt_logprobs is not None
    assert len(got[2].prompt_logprobs) == len(sync[2].prompt_logprobs)
    assert_idle(async_llm)


def test_bad_words_of_several_tokens_match_sync(demo_llm, async_llm):
    # A two-token bad word's ban reads the last sampled id: an async step waits for it.
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [base, base.clone(bad_words=["answer is"]), base.clone(bad_words=["Paris"])]
    sync = demo_llm.generate([PROMPTS[0]] * 3, params)
    got = async_llm.generate([PROMPTS[0]] * 3, params)
    assert ids_and_reasons(got) == ids_and_reasons(sync)
    assert " answer is" in got[0].outputs[0].text  # the greedy text the bans change
    assert " answer is" not in got[1].outputs[0].text and "Paris" not in got[2].outputs[0].text
    assert_idle(async_llm)


def test_stops_never_overshoot(demo_llm, async_llm):
    base = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (ref,) = demo_llm.generate([PROMPTS[3]], base)
    tokens, text = ref.outputs[0].token_ids, ref.outputs[0].text
    stop_id = tokens[3]
    stop_str = text[len(text) // 3 : len(text) // 3 + 3]
    params = [
        base.clone(stop_token_ids=[stop_id]),
        base.clone(stop=[stop_str]),
        base.clone(max_tokens=1),
        base.clone(max_tokens=2),
    ]
    sync = demo_llm.generate([PROMPTS[3]] * 4, params)
    got = async_llm.generate([PROMPTS[3]] * 4, params)
    assert ids_and_reasons(got) == ids_and_reasons(sync)
    assert got[0].outputs[0].token_ids == tokens[: tokens.index(stop_id) + 1]
    assert stop_str not in got[1].outputs[0].text
    assert [len(o.outputs[0].token_ids) for o in got[2:]] == [1, 2]
    assert_idle(async_llm)


def test_streaming_lags_one_step_and_never_emits_a_dropped_token(async_llm):
    engine = async_llm.llm_engine
    params = SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("lag", PROMPTS[0], params)
    first = engine.step()
    assert first == [] and engine._in_flight is not None  # the prefill's token is unread
    seq = engine.requests["lag"].seqs[0]
    assert seq.token_ids[-1] == PLACEHOLDER
    streamed = []
    while engine.has_work():
        for out in engine.step():
            streamed.extend(out.outputs[0].token_ids)
            assert PLACEHOLDER not in out.outputs[0].token_ids
    assert len(streamed) == 5 and PLACEHOLDER not in seq.token_ids
    assert seq.num_tokens == seq.num_prompt_tokens + 5
    assert_idle(async_llm)


def test_abort_with_a_step_in_flight_frees_every_block(async_llm):
    engine = async_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"ab-{i}", prompt, params)
    engine.step()
    engine.step()
    engine.abort_request(["ab-0", "ab-2"])
    outs = {}
    engine.step()  # the aborts' outputs; the in-flight step is still unread
    engine.abort_request(["ab-1", "ab-3"])
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id] = out
    assert {o.outputs[0].finish_reason for o in outs.values()} <= {"abort"}
    for out in outs.values():
        assert PLACEHOLDER not in out.outputs[0].token_ids
    assert_idle(async_llm)


def test_preemption_under_a_small_pool_completes_everything(demo_model_dir, demo_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = demo_llm.generate(PROMPTS, params)
    small = LLM(
        str(demo_model_dir),
        max_model_len=128,
        device="cpu",
        async_scheduling=True,
        num_kvcache_blocks=9,
    )
    got = small.generate(PROMPTS, params)
    assert small.llm_engine.stats().num_preemptions > 0
    assert ids_and_reasons(got) == ids_and_reasons(expected)
    assert_idle(small)


def test_disaggregated_handoff_with_async_engines(demo_model_dir, demo_llm, demo_tokenizer):
    prefill = LLM(str(demo_model_dir), max_model_len=1024, device="cpu", async_scheduling=True)
    decode = LLM(str(demo_model_dir), max_model_len=1024, device="cpu", async_scheduling=True)
    for i, params in enumerate(
        [
            SamplingParams(temperature=0, max_tokens=8),
            SamplingParams(temperature=0.8, seed=5, max_tokens=8),
        ]
    ):
        ids = demo_tokenizer.encode(PROMPTS[2])
        (single,) = demo_llm.generate([ids], params)
        _, out = disaggregated(prefill, decode, f"async-h{i}", ids, params)
        assert out.outputs[0].token_ids == single.outputs[0].token_ids
        assert out.outputs[0].finish_reason == single.outputs[0].finish_reason
    assert_idle(prefill)
    assert_idle(decode)
