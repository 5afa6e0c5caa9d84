"""Incremental detokenization and stop strings, free of torch.

Text is produced a token at a time and equals what ``tokenizer.decode`` gives
for the whole output. Fast tokenizers (a tokenizer.json) use tokenizers'
``DecodeStream``, as vLLM v1 does; others decode a small window of ids twice
and emit the difference. Either way a token holding part of a UTF-8 character
yields nothing until the character is complete, and decoding starts a few
tokens back in the prompt so that tokenizers which decide spacing from context
(SentencePiece's "▁") print the first output token right.

``skip_special_tokens`` drops special tokens from the text. With
``spaces_between_special_tokens=False`` (and special tokens kept), two added
tokens in a row are joined with no space even where the tokenizer's decoder
would insert one (vLLM v1's semantics; byte-level BPE inserts none anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams

# How many prompt tokens decoding starts back (vLLM uses the same 5).
INITIAL_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class TokenizerInfo:
    """What detokenization needs from a Hugging Face tokenizer, computed once."""

    tokenizer: Any
    backend: Any | None  # the tokenizers.Tokenizer behind a fast tokenizer
    added_tokens: dict[int, str]  # id -> content of every added token

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenizerInfo:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        added = {i: getattr(tok, "content", str(tok)) for i, tok in decoder.items()}
        return cls(tokenizer, getattr(tokenizer, "_tokenizer", None), added)

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class IncrementalDetokenizer:
    __slots__ = (
        "_ids",
        "_info",
        "_last_added",
        "_prefix_offset",
        "_read_offset",
        "_skip_special",
        "_spaces",
        "_stream",
        "output_text",
    )

    def __init__(self, info: TokenizerInfo, prompt_token_ids: list[int], params: SamplingParams):
        self._info = info
        self._skip_special = params.skip_special_tokens
        self._spaces = params.skip_special_tokens or params.spaces_between_special_tokens
        self._last_added = False
        self.output_text = ""
        tail = list(prompt_token_ids[-INITIAL_OFFSET:])
        self._ids = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self._stream = None
        if info.backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=tail, skip_special_tokens=self._skip_special)

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; returns the text it completes (maybe empty)."""
        delta = self._step(token_id)
        if not self._spaces:
            content = self._info.added_tokens.get(token_id)
            if content is not None and self._last_added and delta:
                delta = content
            self._last_added = content is not None
        self.output_text += delta
        return delta

    def _step(self, token_id: int) -> str:
        if self._stream is not None:
            try:
                text = self._stream.step(self._info.backend, token_id) or ""
                self._ids.append(token_id)
                return text
            except Exception:
                # DecodeStream rejects some id sequences (invalid byte prefixes);
                # window decoding takes over from here for this sequence.
                self._stream = None
                self._read_offset = len(self._ids)
                self._prefix_offset = max(self._read_offset - INITIAL_OFFSET, 0)
        self._ids.append(token_id)
        decode = self._info.tokenizer.decode
        prefix_text = decode(
            self._ids[self._prefix_offset : self._read_offset],
            skip_special_tokens=self._skip_special,
        )
        full_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""  # part of a multi-byte character, or a token with no text yet
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def truncate(self, length: int) -> None:
        self.output_text = self.output_text[:length]


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Find the first stop string that the last ``num_new_chars`` characters completed.

    Returns ``(stop_string, length_to_keep)`` or None. Only the tail is searched:
    a match must end inside the new characters, but may start before them (a stop
    string that spans tokens).
    """
    if not stop or num_new_chars <= 0:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - num_new_chars - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    if best is None:
        return None
    idx, s = best
    return s, idx + len(s) if include_stop_str_in_output else idx


def stop_holdback(params: SamplingParams) -> int:
    """Characters a stream must hold back so it never emits part of a stop string."""
    if not params.stop_strings or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop_strings) - 1
