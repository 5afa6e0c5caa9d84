"""StructuredOutputsConfig: the engine's structured-outputs options (vLLM's names
where vLLM has them), torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# "auto" picks xgrammar (vLLM's and SGLang's default).
SUPPORTED_BACKENDS = ("auto", "xgrammar")
DEFAULT_COMPILE_TIMEOUT_S = 30.0
DEFAULT_GRAMMAR_CACHE_SIZE = 256
DEFAULT_COMPILE_WORKERS = 2


@dataclass(slots=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    # Engine-wide: JSON output without free whitespace (a request may ask too).
    disable_any_whitespace: bool = False
    # Not vLLM's: a grammar that has not compiled within this many seconds
    # fails its request (finish_reason "abort"), never the engine.
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    # Compiled grammars kept, least recently used evicted first.
    grammar_cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE
    # Background threads that compile (each compile also uses xgrammar's own).
    compile_workers: int = DEFAULT_COMPILE_WORKERS

    def __post_init__(self) -> None:
        if self.backend not in SUPPORTED_BACKENDS:
            raise ValueError(
                f"structured_outputs_config.backend must be one of "
                f"{', '.join(repr(b) for b in SUPPORTED_BACKENDS)}; got {self.backend!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs_config.disable_any_whitespace must be a bool")
        t = self.compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            raise ValueError(
                f"structured_outputs_config.compile_timeout_s must be a positive number; got {t!r}"
            )
        for name in ("grammar_cache_size", "compile_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(
                    f"structured_outputs_config.{name} must be an integer >= 1; got {v!r}"
                )

    @classmethod
    def parse(cls, value: Any, guided_decoding_backend: str | None) -> StructuredOutputsConfig:
        """From None, a dict, or a StructuredOutputsConfig; ``guided_decoding_backend``
        (vLLM's older option) names the backend when the config does not."""
        if value is None:
            value = {}
        if isinstance(value, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise ValueError(
                    f"unknown structured_outputs_config field(s) {', '.join(unknown)}; "
                    f"valid: {', '.join(sorted(names))}"
                )
            value = dict(value)
            if guided_decoding_backend is not None:
                if value.get("backend", guided_decoding_backend) != guided_decoding_backend:
                    raise ValueError(
                        "guided_decoding_backend and structured_outputs_config.backend disagree"
                    )
                value["backend"] = guided_decoding_backend
            return cls(**value)
        if isinstance(value, cls):
            if guided_decoding_backend is not None and guided_decoding_backend != value.backend:
                raise ValueError(
                    "guided_decoding_backend and structured_outputs_config.backend disagree"
                )
            return value
        raise ValueError(
            f"structured_outputs_config must be a dict or StructuredOutputsConfig; got {value!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
