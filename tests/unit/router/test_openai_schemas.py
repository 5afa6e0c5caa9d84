"""The OpenAI completions body's prompt: which JSON shapes are token ids, which
text, and what is refused (router/http/schemas.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from router.http.schemas import CompletionRequest, InvalidField


def generate(prompt):
    return CompletionRequest.model_validate_json(json.dumps({"prompt": prompt})).to_generate()


def test_token_ids_text_and_batches_keep_their_kind():
    (ids,) = generate([5, 7, 9])
    assert ids.WhichOneof("input") == "token_ids" and list(ids.token_ids.ids) == [5, 7, 9]
    (text,) = generate("12")
    assert text.WhichOneof("input") == "prompt" and text.prompt == "12"
    # Strings that look like numbers stay text: ids are tried strictly.
    assert [g.prompt for g in generate(["12", "a"])] == ["12", "a"]
    batch = generate([[1, 2], [3]])
    assert [list(g.token_ids.ids) for g in batch] == [[1, 2], [3]]


@pytest.mark.parametrize("prompt", [[1, True], [1, 2.5], [1, "2"], [], {"a": 1}])
def test_mixed_or_non_integer_prompts_are_refused(prompt):
    with pytest.raises((ValidationError, InvalidField)):
        generate(prompt)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 10**30])
def test_a_token_id_protobuf_cannot_hold_names_the_prompt(bad):
    with pytest.raises(InvalidField) as e:
        generate([1, bad])
    assert e.value.param == "prompt" and "out of range" in str(e.value)
