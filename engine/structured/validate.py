"""Checks a structured-outputs spec without compiling it (torch-free).

Every error is a ValueError whose message starts with the field
(``structured_outputs.json``, ``structured_outputs.regex``, ...) and says why.
What is refused here:
- text that does not parse: JSON, a regex, an EBNF grammar;
- features the backend would silently ignore, so that output could break the
  spec (a JSON schema's ``uniqueItems`` or ``not``, a regex's lookahead): an
  honest refusal beats output that does not match what was asked;
- specs too large to compile within the engine's bound (``MAX_SPEC_CHARS``,
  ``MAX_SCHEMA_DEPTH``, ``MAX_CHOICES``): the router refuses them, not a node.
A spec that passes may still fail to compile on a node (a corner this checker
does not model, or a compile that outlasts ``compile_timeout_s``): that request
alone then ends with finish_reason "abort" and the error.
"""

from __future__ import annotations

import json

from engine.sampling_params import StructuredOutputsParams
from engine.structured.checks import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    check_regex,
    check_size,
)
from engine.structured.ebnf import check_ebnf
from engine.structured.json_schema import check_schema

__all__ = ["MAX_CHOICES", "MAX_SCHEMA_DEPTH", "MAX_SPEC_CHARS", "choice_grammar", "validate"]


def validate(so: StructuredOutputsParams | None) -> None:
    """Raise ValueError naming the field and the reason if ``so`` cannot be served."""
    if so is None:
        return
    if not isinstance(so, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {so!r}")
    kind = so.kind
    if kind == "json":
        check_schema(so.json, "structured_outputs.json", MAX_SPEC_CHARS, MAX_SCHEMA_DEPTH)
    elif kind == "regex":
        check_regex(so.regex, "structured_outputs.regex")
    elif kind == "choice":
        check_choice(so.choice)
    elif kind == "grammar":
        check_size("structured_outputs.grammar", so.grammar)
        check_ebnf(so.grammar, "structured_outputs.grammar")
    elif kind == "structural_tag":
        _check_structural_tag(so.structural_tag)
    if so.whitespace_pattern is not None:
        raise ValueError(
            "structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
            "(use disable_any_whitespace for compact JSON)"
        )


def check_choice(choice: list[str]) -> None:
    if len(choice) > MAX_CHOICES:
        raise ValueError(
            f"structured_outputs.choice has {len(choice)} entries, at most {MAX_CHOICES}"
        )
    if sum(len(c) for c in choice) > MAX_SPEC_CHARS:
        raise ValueError(
            f"structured_outputs.choice is too large to compile: more than {MAX_SPEC_CHARS} "
            "characters in all"
        )
    if any(c == "" for c in choice):
        raise ValueError("structured_outputs.choice must not contain an empty string")


def choice_grammar(choice: list[str]) -> str:
    """The EBNF grammar of exactly one of the choices (JSON string escapes are
    EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choice)


def _check_structural_tag(text: str) -> None:
    check_size("structured_outputs.structural_tag", text)
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("structured_outputs.structural_tag must be a JSON object")
