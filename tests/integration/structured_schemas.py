"""JSON schemas for structured-output tests: every keyword family xgrammar
enforces, each small enough that a tiny model's output ends within a few
dozen tokens (strings, arrays and numbers bounded)."""

from __future__ import annotations

S = {"type": "string", "minLength": 1, "maxLength": 8}
I = {"type": "integer", "minimum": 0, "maximum": 99}  # noqa: E741


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    out = {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
    }
    return out | extra


SCHEMAS: list[dict] = [
    # flat objects and scalar types
    obj({"name": S, "age": I}),
    obj({"ok": {"type": "boolean"}, "nothing": {"type": "null"}}),
    obj({"x": {"type": "number", "minimum": -5, "maximum": 5}}),
    obj({"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
    obj({"n": {"type": "integer", "minimum": 0, "maximum": 50, "multipleOf": 5}}),
    obj({"v": {"type": ["string", "null"], "maxLength": 5}}),
    # enums, const
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"level": {"enum": [1, 2, 3]}, "tag": {"const": "fixed"}}),
    {"enum": ["yes", "no", "maybe"]},
    # string patterns, lengths, formats
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    obj({"word": {"type": "string", "minLength": 3, "maxLength": 4}}),
    obj({"hex": {"type": "string", "pattern": "^[0-9a-f]{4,6}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    # arrays: min/max items, tuples, top level
    obj({"nums": {"type": "array", "items": I, "minItems": 2, "maxItems": 4}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    obj({"pair": {"type": "array", "prefixItems": [S, I], "items": False}}),
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    obj({"grid": {"type": "array", "maxItems": 2,
                  "items": {"type": "array", "items": I, "minItems": 1, "maxItems": 2}}}),
    # nested objects
    obj({"user": obj({"name": S, "admin": {"type": "boolean"}})}),
    obj({"a": obj({"b": obj({"c": I})})}),
    obj({"items": {"type": "array", "maxItems": 2, "items": obj({"sku": S, "qty": I})}}),
    # required and optional, additionalProperties
    obj({"must": I, "may": S}, required=["must"]),
    obj({"p": I, "q": I, "r": {"type": "boolean"}}, additionalProperties=False),
    obj({"only_optional": S}, required=[]),
    # anyOf / oneOf
    obj({"v": {"anyOf": [S, I]}}),
    obj({"shape": {"anyOf": [obj({"r": I}), obj({"w": I, "h": I})]}}),
    obj({"v": {"oneOf": [{"type": "boolean"}, {"type": "integer", "minimum": 0, "maximum": 9}]}}),
    # $ref / $defs
    {"$defs": {"Point": obj({"x": I, "y": I})}, **obj({"p": {"$ref": "#/$defs/Point"}})},
    {"$defs": {"Tag": {"enum": ["x", "y"]}},
     **obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "minItems": 1, "maxItems": 2}})},
    {"$defs": {"Name": S, "Person": obj({"name": {"$ref": "#/$defs/Name"}, "age": I})},
     **obj({"boss": {"$ref": "#/$defs/Person"}, "size": I})},
    # top-level scalars
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "boolean"},
]  # fmt: skip
