"""Token-id prompts are checked exactly as before the fast paths (engine/input_processor.py)."""

from __future__ import annotations

import enum

import pytest

from engine import input_processor
from engine.config import EngineConfig
from engine.input_processor import InputProcessor
from engine.models.shapes import write_shape_dir
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    model = write_shape_dir("smollm2-135m", tmp_path_factory.mktemp("model") / "m")
    config = EngineConfig(model=str(model), skip_tokenizer_init=True, max_model_len=512)
    return InputProcessor(config, None, frozenset({0}))


@pytest.fixture(autouse=True, params=["c-bounds", "python"])
def bounds(request, monkeypatch):
    """Every test with the ids' bounds taken in one C pass, and without it (an
    install with no compiler): the same answers."""
    if request.param == "python":
        monkeypatch.setattr(input_processor, "id_bounds", lambda ids: None)


class Token(enum.IntEnum):
    A = 7


def process(processor, ids, **params):
    return processor.process({"prompt_token_ids": ids}, SamplingParams(**params))


def test_plain_and_subclassed_ints_pass(processor):
    assert process(processor, [1, 2, 3]).token_ids == [1, 2, 3]
    assert process(processor, (4, Token.A)).token_ids == [4, 7]
    last = processor.vocab_size - 1
    assert process(processor, [0, last]).token_ids == [0, last]


@pytest.mark.parametrize("ids", [[1, True], [1, 2.0], [1, "2"], [1, None], "12"])
def test_anything_but_ints_is_refused(processor, ids):
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
        process(processor, ids)


@pytest.mark.parametrize("bad", [-1, "vocab", "far"])
def test_the_first_id_outside_the_vocabulary_is_named(processor, bad):
    value = {"vocab": processor.vocab_size, "far": 10**12}.get(bad, bad)
    with pytest.raises(ValueError, match=rf"prompt_token_ids contains {value}, outside"):
        process(processor, [5, value, -7, 6])


def test_sampling_ids_are_checked_against_the_vocabulary(processor):
    with pytest.raises(ValueError, match=f"stop_token_ids contains {processor.vocab_size}"):
        process(processor, [1, 2], stop_token_ids=[3, processor.vocab_size])


def test_an_unset_max_tokens_is_what_the_context_leaves(processor):
    # vLLM's rule, the one router and nodes share (issue 50, item 1).
    assert process(processor, [1, 2, 3], max_tokens=None).max_tokens == 512 - 3
    assert process(processor, [1, 2, 3], max_tokens=7).max_tokens == 7
    processor.max_model_len = 100  # a router serving its nodes' shorter length
    try:
        assert process(processor, [1] * 40, max_tokens=None).max_tokens == 60
        with pytest.raises(ValueError, match="prompt has 100 tokens but max_model_len is 100"):
            process(processor, [1] * 100, max_tokens=None)
    finally:
        processor.max_model_len = 512


def test_min_tokens_beyond_the_context_left_is_refused(processor):
    with pytest.raises(ValueError, match="min_tokens 600 is more than the 509 tokens"):
        process(processor, [1, 2, 3], max_tokens=None, min_tokens=600)


def test_a_request_keeps_its_resolved_max_tokens(processor):
    req = processor.new_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=None), 0.0, None)
    assert req.params.max_tokens == 508 and req.seqs[0].params.max_tokens == 508
