"""Sampling parameters through the whole engine on the demo model: each one has its effect."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.engine.conftest import assert_idle

PROMPT = "Write a short poem about autumn leaves."


@pytest.fixture(scope="module")
def chat_prompt(demo_tokenizer) -> list[int]:
    return demo_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )


@pytest.fixture(scope="module")
def greedy_out(demo_llm, chat_prompt):
    (out,) = demo_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=40))
    return out.outputs[0]


def gen(llm, prompt, **params):
    (out,) = llm.generate([prompt], SamplingParams(**params))
    return out.outputs[0]


def test_seeded_sampling_is_reproducible_across_batch_compositions(demo_llm, chat_prompt):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    alone = demo_llm.generate([chat_prompt], params)[0].outputs[0].token_ids
    others = ["Tell me about the moon.", "Count to five.", "What is rust?"]
    mixed_params = [SamplingParams(temperature=0.9, max_tokens=30)] * 3 + [params]
    mixed = demo_llm.generate(others + [chat_prompt], mixed_params)[-1].outputs[0].token_ids
    first = demo_llm.generate([chat_prompt, *others], [params] + mixed_params[:3])[0]
    assert alone == mixed == first.outputs[0].token_ids
    other_seed = demo_llm.generate([chat_prompt], params.clone(seed=4321))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_completions_differ_and_are_reproducible(demo_llm, chat_prompt):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    (a,) = demo_llm.generate([chat_prompt], params)
    (b,) = demo_llm.generate([chat_prompt], params)
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_idle(demo_llm)


def test_restrictive_filters_reduce_to_greedy(demo_llm, chat_prompt, greedy_out):
    filters = (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0))
    params = [SamplingParams(temperature=1.0, max_tokens=40, **f) for f in filters]
    outs = demo_llm.generate([chat_prompt] * len(params), params)  # one batch, a filter a row
    for f, out in zip(filters, outs, strict=True):
        assert out.outputs[0].token_ids == greedy_out.token_ids, f


def test_max_tokens_finishes_with_length(demo_llm, chat_prompt, greedy_out):
    out = gen(demo_llm, chat_prompt, temperature=0, max_tokens=5)
    assert out.token_ids == greedy_out.token_ids[:5] and out.finish_reason == "length"


def test_stop_string_cuts_the_text(demo_llm, chat_prompt, greedy_out):
    text = greedy_out.text
    stop = text[12:17]  # spans tokens in general
    assert stop.strip() and text.find(stop) == 12
    out = gen(demo_llm, chat_prompt, temperature=0, max_tokens=40, stop=[stop])
    assert out.text == text[:12]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = gen(
        demo_llm,
        chat_prompt,
        temperature=0,
        max_tokens=40,
        stop=stop,
        include_stop_str_in_output=True,
    )
    assert kept.text == text[:17]


def test_stop_token_ids(demo_llm, chat_prompt, greedy_out):
    target = greedy_out.token_ids[6]
    first = greedy_out.token_ids.index(target)
    out = gen(demo_llm, chat_prompt, temperature=0, max_tokens=40, stop_token_ids=[target])
    assert out.token_ids == greedy_out.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_and_min_tokens(demo_llm, demo_tokenizer):
    prompt = demo_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with just the word yes."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    short = gen(demo_llm, prompt, temperature=0, max_tokens=64)
    assert short.finish_reason == "stop" and short.stop_reason is None
    assert short.token_ids[-1] == demo_tokenizer.eos_token_id
    n = len(short.token_ids)
    assert n < 40
    longer = gen(demo_llm, prompt, temperature=0, max_tokens=64, min_tokens=n + 5)
    assert len(longer.token_ids) >= n + 5
    assert demo_tokenizer.eos_token_id not in longer.token_ids[: n + 4]
    ignored = gen(demo_llm, prompt, temperature=0, max_tokens=n + 8, ignore_eos=True)
    assert len(ignored.token_ids) == n + 8 and ignored.finish_reason == "length"


def test_logit_bias_and_allowed_token_ids(demo_llm, chat_prompt, demo_tokenizer):
    word = demo_tokenizer.encode(" banana")[0]
    biased = gen(demo_llm, chat_prompt, temperature=0, max_tokens=6, logit_bias={word: 100.0})
    assert biased.token_ids == [word] * 6
    allowed = demo_tokenizer.encode(" yes no maybe")
    out = gen(
        demo_llm, chat_prompt, temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=allowed
    )
    assert set(out.token_ids) <= set(allowed)


def repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


def test_penalties_change_repetition(demo_llm):
    prompt = "Hello! Hello! Hello! Hello!"
    plain = gen(demo_llm, prompt, temperature=0, max_tokens=16)
    assert repeats(plain.token_ids) >= 12  # greedy keeps repeating "Hello!"
    for params in (
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
    ):
        out = gen(demo_llm, prompt, temperature=0, max_tokens=16, **params)
        assert repeats(out.token_ids) <= 3, params
    # Frequency grows with the count, presence does not: a mild frequency penalty
    # still lets the first repeats through.
    mild = gen(demo_llm, prompt, temperature=0, max_tokens=16, frequency_penalty=0.1)
    assert repeats(mild.token_ids) > 3


def test_truncate_prompt_tokens_and_detokenize(demo_llm, demo_tokenizer):
    ids = demo_tokenizer.encode("one two three four five six seven eight")
    (out,) = demo_llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3)
    )
    assert out.prompt_token_ids == ids[-3:]
    (plain,) = demo_llm.generate([ids[-3:]], SamplingParams(temperature=0, max_tokens=4))
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    (raw,) = demo_llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, detokenize=False))
    assert raw.outputs[0].text == "" and len(raw.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(stop_token_ids=[10**6]), "stop_token_ids"),
        (dict(allowed_token_ids=[49152]), "allowed_token_ids"),
        (dict(logit_bias={10**7: 1.0}), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=50), "prompt_logprobs"),
        (dict(allowed_token_ids=[2], min_tokens=1), "allowed_token_ids holds only stop tokens"),
    ],
)
def test_engine_level_checks_reject_and_leave_the_engine_usable(
    demo_llm, chat_prompt, params, field
):
    with pytest.raises(ValueError, match=field):
        demo_llm.generate([chat_prompt, chat_prompt], SamplingParams(max_tokens=2, **params))
    assert_idle(demo_llm)
    (ok,) = demo_llm.generate([chat_prompt], SamplingParams(temperature=0, max_tokens=2))
    assert len(ok.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 10**6], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        ([5] * 2000, "max_model_len"),
        ({"prompt": "x", "extra": 1}, "unknown prompt field"),
        ({"cache_salt": "s"}, "needs 'prompt'"),
        (3.5, "prompt must be"),
    ],
)
def test_bad_prompts_raise_and_leave_the_engine_usable(demo_llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        demo_llm.generate(["fine prompt", prompt], SamplingParams(max_tokens=2))
    assert_idle(demo_llm)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0),
        dict(temperature=0.8, seed=11),
    ],
    ids=["greedy", "seeded"],
)
def test_penalties_continue_exactly_across_a_migration(demo_llm, demo_tokenizer, sampling):
    """A migrated request (router/migration.py) arrives as prompt + the tokens
    generated so far, with resume_offset = their count: it continues with the
    same tokens as the undisturbed request, presence and frequency penalties
    included (they count those prompt tokens as output)."""
    prompt = demo_tokenizer.encode("List the days of the week, then list them again:")
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.1)
    total, k = 32, 12
    whole = gen(demo_llm, prompt, max_tokens=total, ignore_eos=True, **penalties, **sampling)
    moved = {"prompt_token_ids": prompt + list(whole.token_ids[:k])}
    rest = gen(
        demo_llm,
        moved,
        max_tokens=total - k,
        ignore_eos=True,
        resume_offset=k,
        **penalties,
        **sampling,
    )
    assert list(rest.token_ids) == list(whole.token_ids[k:])
    # Not vacuous: counted as prompt, the earlier tokens escape the penalties.
    if sampling["temperature"] == 0:
        naive = gen(demo_llm, moved, max_tokens=total - k, ignore_eos=True, **penalties, **sampling)
        assert list(naive.token_ids) != list(whole.token_ids[k:])
    assert_idle(demo_llm)


def test_resume_offset_beyond_the_prompt_is_refused(demo_llm):
    with pytest.raises(ValueError, match="resume_offset 9 exceeds the prompt's 3 tokens"):
        demo_llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(resume_offset=9))
    assert_idle(demo_llm)
