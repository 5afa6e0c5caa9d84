"""vLLM's bad_words through the engine on the demo model, against HF transformers'
greedy generation with the same token sequences banned (NoBadWordsLogitsProcessor:
the last token of a sequence is banned where the text ends with the others)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.engine.conftest import assert_idle

PROMPT = "The capital of France is"
NEW_TOKENS = 16


def hf_greedy_banned(hf_model, ids: list[int], banned: list[list[int]]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,  # the engine's run below ignores EOS too
            do_sample=False,
            top_p=None,
            top_k=None,
            bad_words_ids=banned,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    ("word", "written"),
    [("Paris", " Paris"), ("answer is", " answer is")],  # one token; two
    ids=["one-token", "two-token"],
)
def test_a_bad_word_the_model_writes_greedily_is_not_written(
    demo_llm, hf_demo, demo_tokenizer, word, written
):
    prompt = demo_tokenizer.encode(PROMPT)
    params = dict(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (free,) = demo_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params))
    assert written in free.outputs[0].text  # what the ban must change
    (out,) = demo_llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(**params, bad_words=[word])
    )
    assert written not in out.outputs[0].text

    def ids(text: str) -> list[int]:
        return demo_tokenizer.encode(text, add_special_tokens=False)

    # vLLM's tokenization, written out: both forms have as many tokens here.
    banned = [ids(word), ids(" " + word)]
    assert len(banned[0]) == len(banned[1]) == len(word.split())
    assert out.outputs[0].token_ids == hf_greedy_banned(hf_demo, prompt, banned)
    assert_idle(demo_llm)
