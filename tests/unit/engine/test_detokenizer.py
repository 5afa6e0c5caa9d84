"""Incremental detokenization and stop strings on the demo model's real tokenizer."""

from __future__ import annotations

import pytest

from engine.detokenizer import (
    IncrementalDetokenizer,
    TokenizerInfo,
    find_stop_string,
    stop_holdback,
)
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def info(demo_tokenizer):
    return TokenizerInfo.from_tokenizer(demo_tokenizer)


def stream(info, tokenizer, text, params=None, prompt="Hi"):
    params = params or SamplingParams()
    detok = IncrementalDetokenizer(info, tokenizer.encode(prompt), params)
    ids = tokenizer.encode(text)
    deltas = [detok.add_token(t) for t in ids]
    return detok, deltas, ids


@pytest.mark.parametrize(
    "text",
    [
        "plain ascii words, with punctuation!",
        "héllo wörld — ça va? 你好，世界",
        "emoji 🙂👍🏽🇫🇷 end",
        "  two leading spaces and\nnew\tlines",
        "code: def f(x):\n    return x ** 2",
    ],
)
def test_incremental_text_equals_full_decode(info, demo_tokenizer, text):
    detok, deltas, ids = stream(info, demo_tokenizer, text)
    assert "".join(deltas) == detok.output_text == demo_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_characters_are_held_until_complete(info, demo_tokenizer):
    _, deltas, ids = stream(info, demo_tokenizer, "🙂")
    assert len(ids) > 1  # byte-level BPE splits the emoji across tokens
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🙂"


def test_special_tokens_decode_as_the_tokenizer_does(info, demo_tokenizer):
    text = "a<|im_end|>\n<|im_start|>assistant b"
    skipped, _, ids = stream(info, demo_tokenizer, text)
    assert (
        skipped.output_text
        == demo_tokenizer.decode(ids, skip_special_tokens=True)
        == "a\nassistant b"
    )
    for spaces in (True, False):
        kept, _, _ = stream(
            info,
            demo_tokenizer,
            text,
            SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces),
        )
        assert kept.output_text == demo_tokenizer.decode(ids) == text


@pytest.fixture(scope="module")
def spaced_tokenizer():
    """A tokenizer whose decoder joins tokens with spaces (WordPiece-style)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<a>": 3, "<b>": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    return tok


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens(spaced_tokenizer):
    info = TokenizerInfo.from_tokenizer(spaced_tokenizer)
    ids = [1, 3, 4, 2]  # hello <a> <b> world
    assert spaced_tokenizer.decode(ids) == "hello <a> <b> world"

    def run(spaces):
        detok = IncrementalDetokenizer(
            info,
            [1],
            SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces),
        )
        for t in ids:
            detok.add_token(t)
        return detok.output_text

    assert run(True) == " hello <a> <b> world"
    assert run(False) == " hello <a><b> world"


def test_window_decoding_without_a_fast_backend(info, demo_tokenizer):
    slow = TokenizerInfo(demo_tokenizer, None, info.added_tokens)
    for text in ("héllo wörld 你好 🙂", "a<|im_end|>b"):
        detok, deltas, ids = stream(slow, demo_tokenizer, text)
        assert detok.output_text == demo_tokenizer.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens():
    text = "Hello wor"
    assert find_stop_string(text, 3, ["world"], False) is None
    text += "ld!"
    assert find_stop_string(text, 3, ["world"], False) == ("world", 6)
    assert find_stop_string(text, 3, ["world"], True) == ("world", 11)


def test_stop_string_must_end_in_new_text():
    # "abc" was already in the text before: it cannot stop the sequence now.
    assert find_stop_string("abcxyz", 3, ["abc"], False) is None
    assert find_stop_string("abcxyz", 3, ["yz", "x"], False) == ("x", 3)  # the earliest wins


def test_holdback_covers_partial_stop_strings():
    assert stop_holdback(SamplingParams(stop=["END", "x"])) == 2
    assert stop_holdback(SamplingParams(stop=["END"], include_stop_str_in_output=True)) == 0
    assert stop_holdback(SamplingParams()) == 0
