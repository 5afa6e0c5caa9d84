"""Sampler on synthetic logits: every parameter changes the outcome the way vLLM defines."""

from __future__ import annotations

import pytest
import torch

from engine.layers.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams

V = 8


def row(params=None, prompt=(), output=(), generator=None, stop_ids=()):
    return SamplingRow(
        params=params or SamplingParams(temperature=0.0),
        token_ids=[*prompt, *output],
        num_prompt_tokens=len(prompt),
        generator=generator,
        min_tokens_stop_ids=list(stop_ids),
    )


def logits(*values):
    return torch.tensor([list(values)], dtype=torch.float32)


BASE = (0.0, 1.0, 3.0, 2.0, 0.5, -1.0, 0.2, 0.1)  # argmax 2, then 3, then 1


@pytest.fixture
def sampler():
    return Sampler(V, torch.device("cpu"), seed=0)


def sample(sampler, rows, lg=None):
    lg = lg if lg is not None else logits(*BASE).repeat(len(rows), 1)
    return sampler(lg.clone(), rows).token_ids


def test_greedy_is_argmax(sampler):
    assert sample(sampler, [row()]) == [2]


def test_allowed_token_ids(sampler):
    assert sample(sampler, [row(SamplingParams(temperature=0, allowed_token_ids=[1, 4]))]) == [1]
    hot = SamplingParams(temperature=1.0, allowed_token_ids=[5, 6])
    assert set(sample(sampler, [row(hot)] * 200)) <= {5, 6}


def test_logit_bias(sampler):
    assert sample(sampler, [row(SamplingParams(temperature=0, logit_bias={5: 10.0}))]) == [5]
    assert sample(sampler, [row(SamplingParams(temperature=0, logit_bias={2: -10.0}))]) == [3]


def test_min_tokens_masks_stop_ids_until_reached(sampler):
    p = SamplingParams(temperature=0, min_tokens=3)
    assert sample(sampler, [row(p, output=[0, 0], stop_ids=[2])]) == [3]
    assert sample(sampler, [row(p, output=[0, 0, 0], stop_ids=[2])]) == [2]


def test_repetition_penalty_covers_prompt_and_output(sampler):
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(sampler, [row(p, prompt=[2])]) == [3]  # 3.0 / 2 < 2.0
    strong = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(sampler, [row(strong, output=[2, 3, 3])]) == [2]  # 1.5 > 1.0, 1.0
    assert sample(
        sampler, [row(SamplingParams(temperature=0, repetition_penalty=1.9), output=[2, 1])]
    ) == [3]
    # Negative logits are multiplied (pushed further down), not divided.
    neg = logits(-1.0, -1.2, -5, -5, -5, -5, -5, -5)
    assert sample(sampler, [row(p, prompt=[0])], neg) == [1]


def test_frequency_penalty_scales_with_count_presence_does_not(sampler):
    freq = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert sample(sampler, [row(freq, output=[2])]) == [2]  # 3.0 - 0.6 > 2.0
    assert sample(sampler, [row(freq, output=[2, 2])]) == [3]  # 3.0 - 1.2 < 2.0
    pres = SamplingParams(temperature=0, presence_penalty=0.6)
    assert sample(sampler, [row(pres, output=[2, 2, 2])]) == [2]  # 3.0 - 0.6 once
    pres2 = SamplingParams(temperature=0, presence_penalty=1.5)
    assert sample(sampler, [row(pres2, output=[2])]) == [3]
    # Penalties apply to generated tokens only, not the prompt.
    assert sample(sampler, [row(freq, prompt=[2, 2, 2])]) == [2]


def test_top_k_keeps_only_the_k_best(sampler):
    p = SamplingParams(temperature=5.0, top_k=2, seed=None)
    assert set(sample(sampler, [row(p)] * 300)) == {2, 3}


def test_top_p_keeps_the_smallest_nucleus(sampler):
    probs = torch.softmax(torch.tensor(BASE), 0)
    assert probs[2] < 0.6 < probs[2] + probs[3]
    p = SamplingParams(temperature=1.0, top_p=0.6)
    assert set(sample(sampler, [row(p)] * 300)) == {2, 3}
    tiny = SamplingParams(temperature=1.0, top_p=0.01)
    assert set(sample(sampler, [row(tiny)] * 50)) == {2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best(sampler):
    probs = torch.softmax(torch.tensor(BASE), 0)
    ratio = probs / probs.max()
    p = SamplingParams(temperature=1.0, min_p=0.3)
    allowed = {i for i in range(V) if ratio[i] >= 0.3}
    assert allowed == {2, 3}
    assert set(sample(sampler, [row(p)] * 300)) == allowed


def test_sampling_follows_the_distribution(sampler):
    lg = logits(0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0).repeat(4000, 1)
    rows = [row(SamplingParams(temperature=1.0))] * 4000
    counts = torch.bincount(torch.tensor(sample(sampler, rows, lg)), minlength=V).float() / 4000
    expected = torch.softmax(lg[0], 0)
    assert torch.allclose(counts, expected, atol=0.03)


def test_temperature_sharpens(sampler):
    lg = logits(0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0).repeat(2000, 1)
    cold = sample(sampler, [row(SamplingParams(temperature=0.2))] * 2000, lg)
    hot = sample(sampler, [row(SamplingParams(temperature=2.0))] * 2000, lg)
    assert cold.count(2) > 1900 and hot.count(2) < 1200


def seeded(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_seeded_rows_ignore_batch_composition(sampler):
    p = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(sampler, [row(p, generator=g)])[0] for g in [seeded(7)] for _ in range(20)]
    g = seeded(7)
    mixed = []
    for i in range(20):
        others = [row(SamplingParams(temperature=1.0)) for _ in range(i % 4)]
        rows = others + [row(p, generator=g)]
        mixed.append(sample(sampler, rows)[-1])
    assert alone == mixed
    other = [sample(sampler, [row(p, generator=g2)])[0] for g2 in [seeded(8)] for _ in range(20)]
    assert other != alone


def test_logprobs_are_raw_log_softmax_with_rank(sampler):
    p = SamplingParams(temperature=0, logprobs=3, logit_bias={5: 10.0})
    out = sampler(logits(*BASE), [row(p)])
    lp = out.logprobs[0]
    raw = torch.log_softmax(torch.tensor(BASE), 0)
    assert out.token_ids == [5]
    assert lp.logprob == pytest.approx(raw[5].item())  # before the bias
    assert lp.rank == 8  # token 5 is the least likely under the raw logits
    assert lp.top_ids == [2, 3, 1]
    assert lp.top_logprobs == pytest.approx(raw[[2, 3, 1]].tolist())


def test_mixed_batch_each_row_uses_its_own_params(sampler):
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, logit_bias={0: 50.0})),
        row(SamplingParams(temperature=0, allowed_token_ids=[7])),
        row(SamplingParams(temperature=1.0, top_k=1)),
    ]
    assert sample(sampler, rows) == [2, 0, 7, 2]


def test_a_repeated_batch_reuses_its_plan_and_masks_still_follow_the_step(sampler):
    # The same rows step after step (steady decoding) reuse one plan; what changes
    # per step (min_tokens counts the row's own growing output) is still applied.
    p = SamplingParams(temperature=0, min_tokens=2)
    r = row(p, output=[0], stop_ids=[2])
    rows = [r, row(SamplingParams(temperature=0, logit_bias={5: 10.0}))]
    assert sample(sampler, rows) == [3, 5]
    plan = sampler._plan
    r.token_ids.append(0)  # the row's sequence grew: min_tokens is reached
    assert sample(sampler, rows) == [2, 5]
    assert sampler._plan is plan
    # Other rows (a new object, even with equal contents) get a plan of their own.
    assert sample(sampler, [row(p, output=[0], stop_ids=[2])]) == [3]
    assert sampler._plan is not plan


def test_a_mixed_batch_samples_each_row_by_its_own_parameters(sampler):
    rows = [
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=1.0, top_k=1)),
        row(SamplingParams(temperature=1.0, allowed_token_ids=[6])),
        row(SamplingParams(temperature=0, logprobs=2)),
    ]
    lg = logits(*BASE).repeat(len(rows), 1)
    out = sampler(lg.clone(), rows)
    assert out.token_ids == [2, 2, 6, 2]
    assert out.logprobs[:3] == [None, None, None]
    assert out.logprobs[3].top_ids == [2, 3]


class WordTokenizer:
    """Each word to its ids, as a tokenizer would encode it (vLLM's calls only)."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False  # vLLM encodes bad words without them
        return self.table[text]


def bad_words_params(*words, **kw) -> SamplingParams:
    p = SamplingParams(temperature=0, bad_words=list(words), **kw)
    # "top" and " top": one token each, two ids; "up top" and " up top": two tokens each.
    p.update_from_tokenizer(
        WordTokenizer({"top": [3], " top": [1], "up top": [4, 2], " up top": [6, 2]})
    )
    return p


def test_a_one_token_bad_word_is_never_sampled_in_either_form(sampler):
    p = bad_words_params("top")
    assert p.bad_words_token_ids == [[3], [1]]
    assert sample(sampler, [row(p)]) == [2]  # BASE's argmax is no bad word
    # Here the best is 3, then 1: both banned, so 4 (0.5) wins.
    assert sample(sampler, [row(p)], logits(0, 1, 0, 3, 0.5, 0, 0, 0)) == [4]


def test_a_bad_words_last_token_is_banned_only_after_its_other_tokens_in_the_output(sampler):
    p = bad_words_params("up top")
    assert p.bad_words_token_ids == [[4, 2], [6, 2]]
    assert sample(sampler, [row(p)]) == [2]  # nothing before it: 2 is free
    assert sample(sampler, [row(p, output=[0, 4])]) == [3]  # "up" then 2: banned
    assert sample(sampler, [row(p, output=[6])]) == [3]  # the spaced form too
    assert sample(sampler, [row(p, output=[4, 0])]) == [2]  # not right before
    # The prompt is not output (vLLM's rule): a prompt ending in 4 bans nothing...
    assert sample(sampler, [row(p, prompt=[9, 4])]) == [2]
    # ...unless a migrated request generated it (the prompt's last resume_offset ids).
    moved = bad_words_params("up top", resume_offset=1)
    assert sample(sampler, [row(moved, prompt=[9, 4])]) == [3]
