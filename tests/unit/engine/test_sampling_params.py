"""SamplingParams: vLLM's names and defaults; invalid values raise ValueError naming the field."""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import RequestOutputKind, SamplingParams


def test_vllm_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.greedy and SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.nan),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("prompt_logprobs", -3),
        ("seed", 2**70),
        ("seed", "x"),
        ("stop", [""]),
        ("stop", [1, 2]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [-3]),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {5: math.inf}),
        ("logit_bias", [1, 2]),
        ("truncate_prompt_tokens", 0),
        ("ignore_eos", "yes"),
        ("output_kind", "delta"),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_normalisation():
    p = SamplingParams(top_k=-1, stop="x", logit_bias={3: 500.0, 4: -1e9})
    assert p.top_k == 0
    assert p.stop_strings == ["x"]
    assert p.logit_bias == {3: 100.0, 4: -100.0}
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)
    tiny = SamplingParams(temperature=1e-6)  # raised to 0.01 and sampled, as in vLLM
    assert tiny.temperature == pytest.approx(1e-2) and not tiny.greedy
    assert SamplingParams(repetition_penalty=2.5).repetition_penalty == 2.5
    assert SamplingParams(stop=["a", "bb"]).stop_strings == ["a", "bb"]


def test_clone_revalidates_and_copies():
    p = SamplingParams(temperature=0.5, stop=["x"])
    q = p.clone(output_kind=RequestOutputKind.DELTA)
    assert q.output_kind is RequestOutputKind.DELTA and q.temperature == 0.5
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=2.0)


def test_bad_words_are_tokenized_as_vllm_does(demo_tokenizer):
    p = SamplingParams(bad_words=["Paris", "  Paris", "little girl", "bustling"])
    p.update_from_tokenizer(demo_tokenizer)

    def ids(text: str) -> list[int]:
        return demo_tokenizer.encode(text, add_special_tokens=False)

    assert len(ids(" bustling")) != len(ids("bustling"))  # the case the rule drops
    assert p.bad_words_token_ids == [
        ids("Paris"),
        ids(" Paris"),
        ids("Paris"),  # leading spaces stripped first
        ids(" Paris"),
        ids("little girl"),
        ids(" little girl"),
        # The spaced form has another number of tokens: vLLM keeps the plain one only.
        ids("bustling"),
    ]
    assert p.reads_output_ids  # "little girl" has two tokens: the output ids decide
    one_token = SamplingParams(bad_words=["Paris"])
    one_token.update_from_tokenizer(demo_tokenizer)
    assert not one_token.reads_output_ids  # a fixed mask
    assert p.clone().bad_words == p.bad_words


@pytest.mark.parametrize("words", [["ok", ""], ["  "], "Paris", [3]])
def test_blank_or_malformed_bad_words_are_refused(words):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=words)
