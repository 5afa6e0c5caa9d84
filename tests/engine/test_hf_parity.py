"""The correctness oracle: greedy generation equals HF transformers `generate` token for
token on the same weights (fp32, CPU), batched and one at a time; logprobs agree."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.conftest import hf_greedy_ids
from tests.engine.conftest import assert_idle

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_greedy(hf_demo, parity_prompts) -> list[list[int]]:
    return [hf_greedy_ids(hf_demo, ids, NEW_TOKENS) for ids in parity_prompts]


def test_at_least_eight_varied_prompts(parity_prompts, hf_greedy):
    assert len(parity_prompts) >= 8
    assert len({len(p) for p in parity_prompts}) >= 6
    assert sum(len(g) == NEW_TOKENS for g in hf_greedy) >= 4  # most run the full 32 tokens


@pytest.fixture(scope="module")
def batched(demo_llm, parity_prompts):
    """Every parity prompt in one generate call."""
    return demo_llm.generate(parity_prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))


def test_batched_greedy_equals_transformers(demo_llm, batched, hf_greedy):
    for out, ref in zip(batched, hf_greedy, strict=True):
        assert out.outputs[0].token_ids == ref
    assert_idle(demo_llm)


def test_one_at_a_time_greedy_equals_transformers(demo_llm, parity_prompts, hf_greedy):
    """A batch of one: the shortest and the longest prompt, and one whose
    reference stops before NEW_TOKENS (an EOS at batch one), when there is one."""
    by_len = sorted(range(len(parity_prompts)), key=lambda i: len(parity_prompts[i]))
    stopped = [i for i in by_len if len(hf_greedy[i]) < NEW_TOKENS]
    picks = sorted({by_len[0], by_len[-1], *stopped[:1]})
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    for i in picks:
        (out,) = demo_llm.generate([parity_prompts[i]], params)
        assert out.outputs[0].token_ids == hf_greedy[i]
        finish = "length" if len(hf_greedy[i]) == NEW_TOKENS else "stop"
        assert out.outputs[0].finish_reason == finish


def test_text_is_the_decoded_tokens(demo_tokenizer, batched):
    for out in batched:
        c = out.outputs[0]
        assert c.text == demo_tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_logprobs_match_transformers(demo_llm, hf_demo, parity_prompts):
    ids = parity_prompts[2]
    (out,) = demo_llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    )
    tokens = out.outputs[0].token_ids
    with torch.inference_mode():
        full = torch.log_softmax(hf_demo(torch.tensor([ids + tokens])).logits[0].float(), -1)
    for step, tok in enumerate(tokens):
        entry = out.outputs[0].logprobs[step]
        ref = full[len(ids) - 1 + step]
        assert entry[tok].logprob == pytest.approx(ref[tok].item(), abs=1e-4)
        assert entry[tok].rank == 1  # greedy picks the most likely token
        top = ref.topk(3).indices.tolist()
        assert set(top) <= set(entry)
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        assert plp[pos][ids[pos]].logprob == pytest.approx(full[pos - 1, ids[pos]].item(), abs=1e-4)
    cumulative = sum(out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens))
    assert out.outputs[0].cumulative_logprob == pytest.approx(cumulative, abs=1e-4)
