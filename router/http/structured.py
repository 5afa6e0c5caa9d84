"""Structured outputs as OpenAI and vLLM spell them -> GenerateRequest's StructuredOutputs.

One request asks for at most one constraint: OpenAI's ``response_format``
(``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs``
object or its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields (and ``tool_choice`` required or named, which
router/http/tools.py turns into a JSON schema). Two at once is a 400 naming
the second: the grammar would have to satisfy both, which no backend does.

Only shapes are checked here; the router validates the spec itself (the
engine's torch-free checker, router/frontend.py) for gRPC and HTTP alike, so
an invalid schema or regex is a 400 naming the field and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proto import pdserve_pb2

# vLLM's structured_outputs object: its names -> the wire's oneof.
_VLLM_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
    "structural_tag": "structural_tag",
}
_VLLM_FLAGS = {"disable_any_whitespace", "disable_fallback", "disable_additional_properties"}


class InvalidField(ValueError):
    """A field the request cannot have (400, ``param`` naming it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class Constraint:
    """The request's one constraint and the field that asked for it."""

    param: str
    spec: pdserve_pb2.StructuredOutputs


def json_schema_spec(schema: Any, param: str) -> pdserve_pb2.StructuredOutputs:
    if isinstance(schema, str):
        return pdserve_pb2.StructuredOutputs(json_schema=schema)
    if not isinstance(schema, dict | bool):
        raise InvalidField(param, f"{param} must be a JSON schema (an object)")
    return pdserve_pb2.StructuredOutputs(json_schema=json.dumps(schema))


def from_response_format(value: dict | None) -> Constraint | None:
    """OpenAI's ``response_format``; None for text (or absent)."""
    if not value:
        return None
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Constraint("response_format", pdserve_pb2.StructuredOutputs(json_object=True))
    if kind != "json_schema":
        raise InvalidField(
            "response_format.type",
            f"response_format type {kind!r} is not supported: use text, json_object or json_schema",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidField(
            "response_format.json_schema",
            "response_format type json_schema needs a json_schema object (name, schema, strict)",
        )
    if not isinstance(spec.get("name", ""), str):
        raise InvalidField(
            "response_format.json_schema.name", "response_format.json_schema.name must be a string"
        )
    if spec.get("strict") not in (None, True, False):
        raise InvalidField(
            "response_format.json_schema.strict",
            "response_format.json_schema.strict must be a boolean",
        )
    # strict or not, the schema is enforced: a grammar cannot follow it loosely.
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return Constraint("response_format", pdserve_pb2.StructuredOutputs(json_object=True))
    param = "response_format.json_schema.schema"
    return Constraint(param, json_schema_spec(schema, param))


def from_vllm_object(value: Any) -> Constraint | None:
    """vLLM's ``structured_outputs`` object (its StructuredOutputsParams' fields)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidField("structured_outputs", "structured_outputs must be an object")
    unknown = sorted(set(value) - set(_VLLM_KINDS) - _VLLM_FLAGS - {"whitespace_pattern"})
    if unknown:
        raise InvalidField(
            "structured_outputs",
            f"unknown structured_outputs field(s) {', '.join(unknown)}; valid: "
            f"{', '.join(sorted(set(_VLLM_KINDS) | _VLLM_FLAGS))}",
        )
    if value.get("whitespace_pattern") is not None:
        raise InvalidField(
            "structured_outputs.whitespace_pattern",
            "structured_outputs.whitespace_pattern is not supported (use disable_any_whitespace)",
        )
    kinds = [k for k in _VLLM_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidField(
            "structured_outputs",
            "structured_outputs must set exactly one of "
            f"{', '.join(_VLLM_KINDS)}; got {', '.join(kinds) or 'none'}",
        )
    (kind,) = kinds
    param = f"structured_outputs.{kind}"
    spec = _spec_of(kind, value[kind], param)
    if value.get("disable_any_whitespace"):
        spec.disable_any_whitespace = True
    return Constraint(param, spec)


def from_guided(extra: dict[str, Any]) -> list[Constraint]:
    """vLLM's older ``guided_*`` fields (each one a constraint of its own)."""
    out = []
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = extra.get(name)
        if value is not None:
            out.append(Constraint(name, _spec_of(kind, value, name)))
    backend = extra.get("guided_decoding_backend")
    if backend not in (None, "", "auto", "xgrammar"):
        raise InvalidField(
            "guided_decoding_backend",
            f"guided_decoding_backend {backend!r} is not supported: this server uses xgrammar",
        )
    if extra.get("guided_whitespace_pattern"):
        raise InvalidField(
            "guided_whitespace_pattern", "guided_whitespace_pattern is not supported"
        )
    return out


def _spec_of(kind: str, value: Any, param: str) -> pdserve_pb2.StructuredOutputs:
    if kind == "json":
        return json_schema_spec(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidField(param, f"{param} must be a list of strings")
        spec = pdserve_pb2.StructuredOutputs()
        spec.choice.choices.extend(value)
        spec.choice.SetInParent()
        return spec
    if kind == "json_object":
        if value is not True:
            raise InvalidField(param, f"{param} must be true")
        return pdserve_pb2.StructuredOutputs(json_object=True)
    if not isinstance(value, str):
        raise InvalidField(param, f"{param} must be a string")
    return pdserve_pb2.StructuredOutputs(**{_VLLM_KINDS[kind]: value})


def one_constraint(constraints: list[Constraint | None]) -> Constraint | None:
    """The request's constraint; 400 naming the second when two were asked."""
    asked = [c for c in constraints if c is not None]
    if len(asked) > 1:
        raise InvalidField(
            asked[1].param,
            f"{asked[1].param} and {asked[0].param} both constrain the output: set one",
        )
    return asked[0] if asked else None
