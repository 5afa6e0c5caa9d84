"""Incremental detokenization and stop strings, free of torch.

Text is produced a token at a time by decoding a small window of tokens twice
(up to the last read position, and through the new token) and emitting the
difference. A byte-level BPE token can hold part of a UTF-8 character; while the
window ends in a partial character the decoder yields U+FFFD, and nothing is
emitted until the character is complete. The window starts a few tokens back
into the prompt so that tokenizers which decide spacing from context
(SentencePiece's leading "▁") print the first output token correctly.

Special-token semantics follow vLLM: ``skip_special_tokens`` drops special
tokens from the text; when added tokens are kept, ``spaces_between_special_tokens``
joins them and the surrounding text with single spaces (as Hugging Face's
Python tokenizers do) instead of nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.engine.sampling_params import SamplingParams

# How many prompt tokens the first window reaches back (vLLM uses the same 5).
INITIAL_OFFSET = 5
REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class TokenizerInfo:
    """What detokenization needs from a Hugging Face tokenizer, computed once."""

    tokenizer: Any
    special_ids: frozenset[int]
    added_tokens: frozenset[str]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenizerInfo:
        special = set(tokenizer.all_special_ids)
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
        return cls(tokenizer, frozenset(special), frozenset(tokenizer.get_added_vocab()))

    def tokens_to_string(self, tokens: list[str], spaces_between_special_tokens: bool) -> str:
        if not tokens:
            return ""
        if not self.added_tokens.intersection(tokens):
            return self.tokenizer.convert_tokens_to_string(tokens)
        sub_texts: list[str] = []
        run: list[str] = []
        for tok in tokens:
            if tok in self.added_tokens:
                if run:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(run))
                    run = []
                sub_texts.append(tok)
            else:
                run.append(tok)
        if run:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(run))
        return (" " if spaces_between_special_tokens else "").join(sub_texts)

    def id_to_tokens(self, token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_ids]
        return [t if t is not None else "" for t in self.tokenizer.convert_ids_to_tokens(token_ids)]

    def decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class IncrementalDetokenizer:
    __slots__ = (
        "_info",
        "_prefix_offset",
        "_read_offset",
        "_skip_special",
        "_spaces",
        "_tokens",
        "output_text",
    )

    def __init__(self, info: TokenizerInfo, prompt_token_ids: list[int], params: SamplingParams):
        self._info = info
        self._skip_special = params.skip_special_tokens
        self._spaces = params.spaces_between_special_tokens
        self._tokens = info.id_to_tokens(
            prompt_token_ids[-(INITIAL_OFFSET + 2) :], self._skip_special
        )
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - INITIAL_OFFSET, 0)
        self.output_text = ""

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; returns the text it completes (maybe empty)."""
        self._tokens.extend(self._info.id_to_tokens([token_id], self._skip_special))
        prefix_text = self._info.tokens_to_string(
            self._tokens[self._prefix_offset : self._read_offset], self._spaces
        )
        full_text = self._info.tokens_to_string(self._tokens[self._prefix_offset :], self._spaces)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            # Part of a multi-byte character, or a token with no text yet.
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.output_text += delta
        return delta

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
