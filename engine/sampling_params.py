"""SamplingParams: vLLM's names and semantics, validated with errors that name the field.

Checks that need the model (vocabulary size, max_model_len, max_logprobs) run
when the engine admits a request; everything else runs here, at construction.
"""

from __future__ import annotations

import enum
import json
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

logger = logging.getLogger(__name__)

# Below this a temperature means greedy decoding (vLLM's _SAMPLING_EPS); only 0
# is below it once small positive values are raised to MIN_RANDOM_TEMPERATURE.
GREEDY_TEMPERATURE = 1e-5
# Positive temperatures below this are raised to it, as vLLM does: logits divided
# by less overflow in fp32.
MIN_RANDOM_TEMPERATURE = 1e-2
MAX_SEED = 2**63 - 1
LOGIT_BIAS_LIMIT = 100.0


class RequestOutputKind(enum.Enum):
    """What each engine step reports for a request (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last report (streaming)
    FINAL_ONLY = 2  # nothing until the request finishes


# The constraint kinds of StructuredOutputsParams, exactly one of which is set.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``).

    Exactly one kind is set: ``json`` (a JSON schema, as a dict or its text),
    ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF text, with
    a ``root`` rule), ``json_object`` (any JSON object) or ``structural_tag``
    (xgrammar's structural tag, as JSON text). The checks here are of shape
    only; ``engine.structured.validate`` checks the content without compiling.
    """

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None  # vLLM's False means "not this kind"
        kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}; got {found}"
            )
        for name in ("regex", "grammar", "whitespace_pattern", "structural_tag"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {v!r}")
        if self.json is not None and not isinstance(self.json, str | dict | bool):
            raise ValueError(
                "structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                f"got {type(self.json).__name__}"
            )
        if self.json_object not in (None, True):
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool")
        if self.choice is not None:
            self._check_choice()

    def _check_choice(self) -> None:
        c = self.choice
        if not isinstance(c, list | tuple) or not all(isinstance(s, str) for s in c):
            raise ValueError(f"structured_outputs.choice must be a list of strings, got {c!r}")
        if not c:
            raise ValueError("structured_outputs.choice must not be empty")
        self.choice = list(c)

    @property
    def kind(self) -> str:
        """Which constraint is set ("json", "regex", ...)."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)

    def key(self) -> str:
        """A canonical text of the whole spec: equal specs, equal keys (what the
        grammar cache is keyed by, with the tokenizer)."""
        spec: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From a plain dict (a JSON request body); unknown keys are an error."""
        if not isinstance(values, dict):
            raise ValueError(f"structured_outputs must be an object, got {values!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"unknown structured_outputs field(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(names))}"
            )
        return cls(**values)


# vLLM's older name (``SamplingParams(guided_decoding=GuidedDecodingParams(...))``).
GuidedDecodingParams = StructuredOutputsParams


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """Per-request sampling parameters (field names and defaults follow vLLM)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Words never generated: their token ids come from the engine's tokenizer
    # (update_from_tokenizer, when the engine admits the request).
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name for structured_outputs: accepted, moved there.
    guided_decoding: StructuredOutputsParams | None = None
    # Not vLLM's: a migrated request continues a stream whose first
    # resume_offset tokens, sampled elsewhere, now end its prompt. The seeded
    # generator skips their draws, and frequency / presence penalties count
    # them as output, so the continuation samples what the first node would have.
    resume_offset: int = 0
    # Not vLLM's (it has no per-request switch; a closed vLLM proposal used
    # this name): True opts this request out of the engine's speculative
    # decoding; it decodes one token per step. Its output is the same either
    # way (verification is lossless); only its speed differs.
    disable_spec_decode: bool = False
    # Normalised forms, filled in by __post_init__.
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate_types()
        self._validate_ranges()
        self._normalise()
        self._take_structured_outputs()

    # ----------------------------------------------------------------- checks
    def _validate_types(self) -> None:
        for name in ("n", "top_k", "min_tokens", "resume_offset"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens", "seed"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise ValueError(f"{name} must be an integer or None, got {v!r}")
        for name in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
        ):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "disable_spec_decode",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            allowed = ", ".join(k.name for k in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {allowed}, got {self.output_kind!r}")

    def _validate_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}"
            )
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not -MAX_SEED - 1 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be non-negative, got {v}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be at least 1, got {self.truncate_prompt_tokens}"
            )
        self._validate_stop()
        self._validate_token_lists()
        self._validate_bad_words()

    def _validate_stop(self) -> None:
        stop = self.stop
        if stop is None:
            return
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in items):
            raise ValueError("stop must not contain an empty string")

    def _validate_token_lists(self) -> None:
        for name in ("stop_token_ids", "allowed_token_ids"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, list | tuple) or not all(_is_int(t) for t in v):
                raise ValueError(f"{name} must be a list of integers, got {v!r}")
            if any(t < 0 for t in v):
                raise ValueError(f"{name} must not contain negative token ids, got {v!r}")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids must not be empty")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}"
                )
            for k, b in self.logit_bias.items():
                if not _is_int(k) or k < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {k!r}")
                if not _is_number(b) or not math.isfinite(b):
                    raise ValueError(f"logit_bias values must be finite numbers, got {b!r} for {k}")

    def _validate_bad_words(self) -> None:
        words = self.bad_words
        if words is None:
            return
        if not isinstance(words, list | tuple) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"bad_words must be a list of strings, got {words!r}")
        # A blank word has no tokens to ban (vLLM fails on one with an IndexError).
        if any(not w.strip() for w in words):
            raise ValueError("bad_words must not contain an empty or blank word")
        self.bad_words = list(words)

    def _normalise(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            # vLLM clamps biases to +-100: beyond that a bias already decides alone.
            self.logit_bias = {
                int(k): max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))
                for k, b in self.logit_bias.items()
            }
        if 0.0 < self.temperature < MIN_RANDOM_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s and is raised to it to avoid overflow",
                self.temperature,
                MIN_RANDOM_TEMPERATURE,
            )
            self.temperature = MIN_RANDOM_TEMPERATURE

    def _take_structured_outputs(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError(
                    "set structured_outputs or guided_decoding (its old name), not both"
                )
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        so = self.structured_outputs
        if isinstance(so, dict):
            so = self.structured_outputs = StructuredOutputsParams.from_dict(so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams, got {type(so).__name__}"
            )

    # -------------------------------------------------------------- derived
    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The bad words' token sequences (update_from_tokenizer); empty before it."""
        return self._bad_words_token_ids

    @property
    def reads_output_ids(self) -> bool:
        """Whether sampling reads the output's ids on the host: penalties, and
        bad words of several tokens (their last token is banned only after the others)."""
        return self.needs_penalties or any(len(w) > 1 for w in self._bad_words_token_ids)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """vLLM's tokenization of bad words: each word (its leading spaces
        stripped) as it starts the text, then after a space, the latter kept only
        where it gives a different first token and as many tokens (a word in
        mid-text)."""
        self._bad_words_token_ids = []
        for word in self.bad_words or ():
            for prefix in ("", " "):
                ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                last = self._bad_words_token_ids[-1] if prefix else None
                if last is None or (ids[0] != last[0] and len(ids) == len(last)):
                    self._bad_words_token_ids.append(list(ids))

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy with some fields changed."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)
