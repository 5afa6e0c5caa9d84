"""Checks a JSON schema for structured outputs without compiling it (torch-free).

The rule: refuse what xgrammar would reject, and what it would silently
ignore (output could then break the schema); name the keyword and where it
is (a JSON pointer). Supported: type (one or a list), properties, required,
additionalProperties, patternProperties, propertyNames, min/maxProperties,
items, prefixItems, min/maxItems, contains, enum, const, anyOf, oneOf, allOf
of one schema, local $ref into $defs / definitions, string pattern,
min/maxLength and the formats below, integer and number bounds, integer
multipleOf; annotations (title, description, examples, default, ...) are
ignored as they should be.
"""

from __future__ import annotations

import json
import math
from typing import Any

from engine.structured.checks import check_regex

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
# The string formats xgrammar enforces; others it would ignore. (Its ipv4
# admits octets with leading zeros, which strict validators refuse.)
STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords that would constrain output but that xgrammar leaves out.
UNSUPPORTED = {
    "not": "negation",
    "if": "conditionals",
    "then": "conditionals",
    "else": "conditionals",
    "dependentRequired": "dependencies",
    "dependentSchemas": "dependencies",
    "dependencies": "dependencies",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "recursive references",
    "unevaluatedItems": "unevaluatedItems",
    "minContains": "minContains",
    "maxContains": "maxContains",
}
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "contains")
_COUNTS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"))
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def check_schema(schema: Any, field: str, max_chars: int, max_depth: int) -> None:
    """Raise ValueError (starting with ``field``) unless ``schema`` (a dict, a
    bool or JSON text) is a schema structured outputs can enforce."""
    if isinstance(schema, str):
        if len(schema) > max_chars:
            raise ValueError(
                f"{field} is too large to compile: {len(schema)} characters, at most {max_chars}"
            )
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
    else:
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{field} is not JSON data: {e}") from None
        if len(text) > max_chars:
            raise ValueError(
                f"{field} is too large to compile: {len(text)} characters, at most {max_chars}"
            )
    _Checker(schema, field, max_depth).walk(schema, "#", 0)


class _Checker:
    def __init__(self, root: Any, field: str, max_depth: int) -> None:
        self.root = root
        self.field = field
        self.max_depth = max_depth

    def fail(self, where: str, reason: str) -> None:
        raise ValueError(f"{self.field}: {reason} at {where}")

    def walk(self, node: Any, where: str, depth: int) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            self.fail(
                where, f"a schema must be an object or a boolean, got {json.dumps(node)[:40]}"
            )
        if depth > self.max_depth:
            self.fail(where, f"the schema nests deeper than {self.max_depth} levels")
        for key, what in UNSUPPORTED.items():
            if key in node:
                self.fail(where, f"unsupported schema feature {key!r} ({what})")
        self.check_keywords(node, where)
        for key in _SCHEMA_LISTS:
            if key in node:
                items = node[key]
                if not isinstance(items, list) or not items:
                    self.fail(where, f"{key!r} must be a non-empty list of schemas")
                for i, sub in enumerate(items):
                    self.walk(sub, f"{where}/{key}/{i}", depth + 1)
        for key in _SCHEMA_MAPS:
            if key in node:
                subs = node[key]
                if not isinstance(subs, dict):
                    self.fail(where, f"{key!r} must be an object of schemas")
                for name, sub in subs.items():
                    self.walk(sub, f"{where}/{key}/{_escape(name)}", depth + 1)
        for key in (*_SCHEMA_VALUES, "propertyNames"):
            if key in node:
                self.walk(node[key], f"{where}/{key}", depth + 1)

    def check_keywords(self, node: dict, where: str) -> None:
        self.check_type(node, where)
        if "$ref" in node:
            self.check_ref(node["$ref"], where)
        if "allOf" in node and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
            self.fail(where, "unsupported schema feature 'allOf' of more than one schema")
        if node.get("uniqueItems") is True:
            self.fail(where, "unsupported schema feature 'uniqueItems'")
        if "format" in node and node["format"] not in STRING_FORMATS:
            self.fail(
                where,
                f"unsupported string format {node['format']!r} (supported: "
                f"{', '.join(sorted(STRING_FORMATS))})",
            )
        if "multipleOf" in node:
            m = node["multipleOf"]
            if node.get("type") != "integer" or not _is_int(m) or m <= 0:
                self.fail(
                    where, "'multipleOf' is supported on integers only, as a positive integer"
                )
        if "pattern" in node:
            check_regex(node["pattern"], f"{self.field} pattern at {where}")
        if "required" in node:
            req = node["required"]
            if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
                self.fail(where, "'required' must be a list of property names")
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            self.fail(where, "'enum' must be a non-empty list")
        self.check_numbers(node, where)

    def check_type(self, node: dict, where: str) -> None:
        if "type" not in node:
            return
        t = node["type"]
        types = t if isinstance(t, list) else [t]
        if not types or not all(isinstance(x, str) and x in JSON_TYPES for x in types):
            self.fail(where, f"'type' must be one of {', '.join(sorted(JSON_TYPES))}, got {t!r}")

    def check_numbers(self, node: dict, where: str) -> None:
        for lo_key, hi_key in _COUNTS:
            lo, hi = node.get(lo_key), node.get(hi_key)
            for key, v in ((lo_key, lo), (hi_key, hi)):
                if v is not None and (not _is_int(v) or v < 0):
                    self.fail(where, f"{key!r} must be a non-negative integer, got {v!r}")
            if lo is not None and hi is not None and lo > hi:
                self.fail(where, f"{lo_key} {lo} is greater than {hi_key} {hi}")
        for key in _BOUNDS:
            v = node.get(key)
            if v is not None and (not _is_number(v) or not math.isfinite(v)):
                self.fail(where, f"{key!r} must be a finite number, got {v!r}")
        lo, hi = node.get("minimum"), node.get("maximum")
        if _is_number(lo) and _is_number(hi) and lo > hi:
            self.fail(where, f"minimum {lo} is greater than maximum {hi}")

    def check_ref(self, ref: Any, where: str) -> None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            self.fail(where, f"only local references ('#/...') are supported, got $ref {ref!r}")
        target: Any = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                self.fail(where, f"$ref {ref!r} points at nothing in the schema")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
