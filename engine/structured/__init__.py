"""Structured outputs: a request's output constrained to a JSON schema, a regex,
a choice of strings, an EBNF grammar or any JSON object (vLLM's
``StructuredOutputsParams``), enforced by xgrammar's token bitmasks.

``validate`` checks a spec without compiling it and without torch: the router
calls it (through ``InputProcessor``) so a bad spec is refused before any node
works on it, and every node calls it again on admission. Compiling and
matching (``compiler``, ``manager``) import xgrammar, and so torch, lazily.
"""

from __future__ import annotations

from engine.structured.validate import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    validate,
)

__all__ = ["MAX_CHOICES", "MAX_SCHEMA_DEPTH", "MAX_SPEC_CHARS", "validate"]
