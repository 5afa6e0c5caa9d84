"""Turns what a caller passes (text, token ids, vLLM-style prompt dicts) into checked
token ids, and a checked request into its Request and Sequences.

Every check raises ValueError naming the field, before the engine holds any
state for the request, so a rejected request leaves the engine as it was.

An unset ``max_tokens`` is resolved here, once, by vLLM's rule: whatever the
context leaves after the prompt (``max_model_len - len(prompt)``). The router
and the nodes both run this code, so "up to the context left" means the same
number everywhere; the router sends the resolved value downstream.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from engine.block_hash import ExtraKeys, HasherCache, id_bounds
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, TokenizerInfo, stop_holdback
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence
from engine.structured import validate as validate_structured_outputs

# A prompt: "text", [token ids], {"prompt": text}, or {"prompt_token_ids": [...]};
# dicts may also carry "cache_salt" (tenant isolation of the prefix cache).
PromptType = str | list[int] | dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass(slots=True)
class ProcessedPrompt:
    prompt: str | None
    token_ids: list[int]
    cache_salt: str | None
    max_tokens: int  # the request's, or (unset) what the context leaves after the prompt


def context_left(max_model_len: int, num_prompt_tokens: int) -> int:
    """What an unset max_tokens means (vLLM's rule): the tokens the context
    holds after the prompt. The prompt is always shorter than max_model_len."""
    return max_model_len - num_prompt_tokens


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any | None,
        eos_token_ids: frozenset[int],
        tok_info: TokenizerInfo | None = None,
    ) -> None:
        self.config = config
        # The context length requests are checked against: the engine's own; a
        # router sets the one its nodes serve (router/limits.py).
        self.max_model_len = config.max_model_len
        self.tokenizer = tokenizer
        self.tok_info = tok_info
        self.vocab_size = config.model_config.vocab_size
        self.eos_token_ids = eos_token_ids
        self._seq_ids = itertools.count()

    def new_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float | None,
        hashers: HasherCache | None,
        lora_request: LoRARequest | None = None,
        extra_keys: ExtraKeys = (),
    ) -> Request:
        """A checked request with one Sequence per completion (``n``), not yet queued.
        ``hashers``: the engine's block hashers (None without prefix caching);
        ``extra_keys``: the block identity beyond model and salt (its adapter's)."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        else:
            # A private, re-validated copy: the caller may reuse and edit its object.
            params = params.clone()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        processed = self.process(prompt, params)
        params.max_tokens = processed.max_tokens  # its own copy: resolved once, here
        hasher = hashers.get(processed.cache_salt, extra_keys) if hashers is not None else None
        seqs = []
        for index in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=index,
                token_ids=list(processed.token_ids),
                num_prompt_tokens=len(processed.token_ids),
                params=params,
                hasher=hasher,
                lora_request=lora_request,
            )
            if self.tok_info is not None and params.detokenize:
                seq.detokenizer = IncrementalDetokenizer(self.tok_info, processed.token_ids, params)
            seqs.append(seq)
        return Request(
            request_id=request_id,
            prompt=processed.prompt,
            prompt_token_ids=processed.token_ids,
            params=params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            seqs=seqs,
            cache_salt=processed.cache_salt,
            stop_holdback=stop_holdback(params),
            # The first prompt token has no context, so no logprob.
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        text, token_ids, salt = self._parse(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        self._check_ids("prompt_token_ids", token_ids)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        max_len = self.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {max_len}: the prompt "
                "must be shorter than max_model_len to leave room for output"
            )
        if params.n > self.config.max_num_seqs:
            # Its sequences could never all run at once on any node.
            raise ValueError(
                f"n is {params.n} but max_num_seqs is {self.config.max_num_seqs}: "
                "n must be at most max_num_seqs"
            )
        self._check_params(params)
        if params.resume_offset > len(token_ids):
            raise ValueError(
                f"resume_offset {params.resume_offset} exceeds the prompt's "
                f"{len(token_ids)} tokens (it counts the prompt's last tokens "
                "that a migrated request generated before)"
            )
        return ProcessedPrompt(text, token_ids, salt, self._max_tokens(len(token_ids), params))

    def _max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """The request's max_tokens, or unset, the context left (module docstring)."""
        if params.max_tokens is not None:
            return params.max_tokens
        left = context_left(self.max_model_len, num_prompt)
        if params.min_tokens > left:
            raise ValueError(
                f"min_tokens {params.min_tokens} is more than the {left} tokens the context "
                f"leaves after the prompt's {num_prompt} (max_model_len {self.max_model_len})"
            )
        return left

    def _parse(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise ValueError(
                    f"unknown prompt field(s) {sorted(unknown)}; allowed: {sorted(_PROMPT_KEYS)}"
                )
            salt = prompt.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise ValueError(f"cache_salt must be a string, got {salt!r}")
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], None
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, list | tuple):
            text, ids = None, prompt
        else:
            raise ValueError(
                f"prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}"
            )
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}")
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer; with skip_tokenizer_init=True pass token ids"
                )
            ids = self.tokenizer.encode(text)
        elif not isinstance(ids, list | tuple) or (id_bounds(ids) is None and not _all_ints(ids)):
            raise ValueError("prompt_token_ids must be a list of integers")
        return text, list(ids), salt

    def _check_ids(self, name: str, ids: list[int] | tuple[int, ...]) -> None:
        # Both bounds in one pass in C (engine/_block_hash.c), else min and max
        # (also C); the generator, much slower, only names the culprit.
        if not ids:
            return
        bounds = id_bounds(ids)
        lo, hi = bounds if bounds is not None else (min(ids), max(ids))
        if lo < 0 or hi >= self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(
                f"{name} contains {bad}, outside the vocabulary [0, {self.vocab_size})"
            )

    def _check_params(self, p: SamplingParams) -> None:
        if p.stop_token_ids:
            self._check_ids("stop_token_ids", p.stop_token_ids)
        if p.allowed_token_ids:
            self._check_ids("allowed_token_ids", p.allowed_token_ids)
        if p.logit_bias:
            self._check_ids("logit_bias", list(p.logit_bias))
        if p.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (skip_tokenizer_init=True)")
            p.update_from_tokenizer(self.tokenizer)
            self._check_ids("bad_words", [t for w in p.bad_words_token_ids for t in w])
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(p, name)
            if v is not None and v > limit:
                raise ValueError(f"{name} must be at most max_logprobs ({limit}), got {v}")
        if p.allowed_token_ids and p.min_tokens > 0:
            stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else self.eos_token_ids)
            if set(p.allowed_token_ids) <= stops:
                raise ValueError(
                    "allowed_token_ids holds only stop tokens, which min_tokens forbids: "
                    "no token could be sampled"
                )
        if self.tokenizer is None and p.stop_strings:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True)")
        if p.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer (skip_tokenizer_init=True)")
            validate_structured_outputs(p.structured_outputs)
        if p.stop_strings and not p.detokenize:
            raise ValueError("stop strings need detokenize=True")


def _all_ints(ids: list | tuple) -> bool:
    """Whether every id is an int and none a bool. The set of the ids' types is
    built in C (an 8k-token prompt: about a tenth of the generator's time, which
    the router paid on every request); only int subclasses other than bool need
    the generator."""
    if set(map(type, ids)) <= {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
