"""SpeculativeConfig: vLLM's ``speculative_config`` fields, validated, torch-free.

vLLM's current form is a dict: ``{"method": "ngram", "num_speculative_tokens":
k, "prompt_lookup_max": ..., "prompt_lookup_min": ...}`` or ``{"method":
"draft_model", "model": DIR, "num_speculative_tokens": k}``, with
``disable_by_batch_size``. vLLM's older engine arguments map onto it
(``speculative_model="[ngram]"``, ``ngram_prompt_lookup_max``, ...).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# k beyond this buys nothing a verify step can keep (each rejected position is
# wasted target compute) and bounds the sampler rows a step can add.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeMethod(enum.Enum):
    NGRAM = "ngram"  # prompt lookup over the sequence's own tokens
    DRAFT_MODEL = "draft_model"  # a smaller model proposes


# vLLM's older names -> current fields.
_OLD_NAMES = {
    "speculative_model": "model",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
}
# vLLM's older spelling of the n-gram method, given as the model.
_NGRAM_MODEL = "[ngram]"


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{name} must be an integer; got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"speculative_config.{name} must be {bound}; got {value}")


@dataclass(slots=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    num_speculative_tokens: int
    # The draft model's directory (draft_model only).
    model: str | None = None
    # n-gram: the longest and shortest suffix looked up in the earlier tokens.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # No proposals in a step where this many sequences or more are running:
    # at large batch a step is compute-bound and rejected positions cost.
    disable_by_batch_size: int | None = None
    # vLLM's: the draft model's tensor-parallel size. pdserve shards the draft
    # over the target's ranks, so only the target's size is accepted
    # (EngineConfig checks it against tensor_parallel_size).
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, SpeculativeMethod):
            allowed = ", ".join(repr(m.value) for m in SpeculativeMethod)
            for m in SpeculativeMethod:
                if self.method == m.value:
                    self.method = m
                    break
            else:
                raise ValueError(
                    f"speculative_config.method must be one of {allowed}; got {self.method!r}"
                )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            # vLLM's bound: below 2 it would disable speculation for any batch.
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)
        if self.method is SpeculativeMethod.NGRAM:
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError("speculative_config.model is for method 'draft_model', not 'ngram'")
        if self.draft_tensor_parallel_size is not None:
            raise ValueError(
                "speculative_config.draft_tensor_parallel_size is for method 'draft_model'"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _check_int("prompt_lookup_min", lo, 1)
        _check_int("prompt_lookup_max", hi, 1)
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    def _check_draft_model(self) -> None:
        if self.draft_tensor_parallel_size is not None:
            _check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1)
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config.prompt_lookup_* are for method 'ngram'")
        if not self.model:
            raise ValueError("speculative_config.model (the draft model's directory) is required")
        if not Path(str(self.model)).is_dir():
            raise ValueError(f"speculative_config.model: {self.model!r} is not a directory")
        self.model = str(self.model)

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """From None, a dict (vLLM's fields, or its older names), or a config."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict; got {value!r}")
        given = {}
        for key, v in value.items():
            name = _OLD_NAMES.get(key, key)
            if name in given:
                raise ValueError(f"speculative_config gives {name!r} twice ({key!r})")
            given[name] = v
        if given.get("model") == _NGRAM_MODEL:
            given.pop("model")
            given.setdefault("method", SpeculativeMethod.NGRAM.value)
        if "method" not in given and given.get("model") is not None:
            given["method"] = SpeculativeMethod.DRAFT_MODEL.value
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(
                f"unknown speculative_config field(s) {', '.join(unknown)}; "
                f"valid: {', '.join(sorted(names))}"
            )
        for required in ("method", "num_speculative_tokens"):
            if required not in given:
                raise ValueError(f"speculative_config.{required} is required")
        return cls(**given)

    def to_dict(self) -> dict[str, Any]:
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        plain["method"] = self.method.value
        return {k: v for k, v in plain.items() if v is not None}
