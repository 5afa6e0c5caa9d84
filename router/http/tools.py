"""OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` -> the chat
template's tools and, where a call is forced, a grammar.

- ``none``: the tools reach the template; the output is text, never parsed.
- ``auto`` (the default with tools): the model decides; the server's
  ``--tool-call-parser`` finds calls in its text (router/http/tool_parsers.py).
- ``required``: the output is a JSON array of one call or more (one when
  ``parallel_tool_calls`` is false), each ``{"name": ..., "parameters": {...}}``
  with the named tool's own parameter schema: enforced by the grammar, so it
  always parses, whatever the model's own format (vLLM's way).
- a named function: the output is that function's arguments, enforced by its
  parameters' schema.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine.structured import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS
from engine.structured.json_schema import check_schema
from proto import pdserve_pb2
from router.http.structured import Constraint, InvalidField

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT: dict = {"type": "object"}


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(slots=True)
class ToolPlan:
    """What a request's tools ask of the template, the grammar and the output."""

    choice: ToolChoice
    parameters: dict[str, Any] = field(default_factory=dict)  # by tool name
    named: str | None = None
    parallel: bool = True
    messages: list[pdserve_pb2.Tool] = field(default_factory=list)

    def constraint(self) -> Constraint | None:
        if self.choice is ToolChoice.NAMED:
            schema = self.parameters[self.named]
        elif self.choice is ToolChoice.REQUIRED:
            schema = self.required_schema()
        else:
            return None
        # Compact JSON: free whitespace adds nothing to a call's arguments, and a
        # model unsure of the format can spend its max_tokens in it.
        spec = pdserve_pb2.StructuredOutputs(
            json_schema=json.dumps(schema), disable_any_whitespace=True
        )
        return Constraint("tool_choice", spec)

    def required_schema(self) -> dict:
        """An array of calls, each of one tool with its own parameters; every
        tool's ``$defs`` moved to the root, where its local refs point."""
        defs: dict[str, Any] = {}
        calls = []
        for name, params in self.parameters.items():
            params = dict(params)
            for key in ("$defs", "definitions"):
                for def_name, schema in (params.pop(key, None) or {}).items():
                    if defs.setdefault(f"{key}/{def_name}", schema) != schema:
                        raise InvalidField(
                            "tools",
                            f"tools define {key}/{def_name} differently: rename one",
                        )
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": params},
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        for key, value in defs.items():
            kind, name = key.split("/", 1)
            schema.setdefault(kind, {})[name] = value
        return schema


def plan_tools(
    tools: list | None, tool_choice: Any, parallel: bool | None, parser: str | None
) -> ToolPlan | None:
    """The request's plan, or None without tools; 400 naming a bad field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidField("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidField("tools", "tools must be a list")
    plan = ToolPlan(ToolChoice.AUTO, parallel=parallel is not False)
    for i, tool in enumerate(tools):
        name, params, message = _tool(i, tool)
        if name in plan.parameters:
            raise InvalidField(f"tools.{i}.function.name", f"two tools are named {name!r}")
        plan.parameters[name] = params
        plan.messages.append(message)
    plan.choice, plan.named = _choice(tool_choice, plan.parameters)
    if plan.choice is ToolChoice.AUTO and parser is None:
        raise InvalidField(
            "tool_choice",
            "tool_choice 'auto' needs a tool-call parser: start the router with "
            "--tool-call-parser, or use tool_choice 'required' or a named function",
        )
    return plan


def _tool(i: int, tool: Any) -> tuple[str, dict, pdserve_pb2.Tool]:
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidField(f"{where}.type", "only tools of type 'function' are supported")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidField(f"{where}.function", f"{where} needs a function object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidField(
            f"{where}.function.name",
            "a function's name must be 1-64 letters, digits, '_' or '-'",
        )
    params = function.get("parameters")
    if params is None:
        params = _ANY_OBJECT
    param = f"{where}.function.parameters"
    if not isinstance(params, dict):
        raise InvalidField(param, f"{param} must be a JSON schema (an object)")
    try:
        check_schema(params, param, MAX_SPEC_CHARS, MAX_SCHEMA_DEPTH)
    except ValueError as e:
        raise InvalidField(param, str(e)) from None
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidField(f"{where}.function.description", "must be a string")
    message = pdserve_pb2.Tool(name=name, description=description, parameters=json.dumps(params))
    return name, params, message


def _choice(value: Any, parameters: dict) -> tuple[ToolChoice, str | None]:
    if value is None or value == "auto":
        return ToolChoice.AUTO, None
    if value == "none":
        return ToolChoice.NONE, None
    if value == "required":
        return ToolChoice.REQUIRED, None
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name")
        if name not in parameters:
            raise InvalidField(
                "tool_choice.function.name", f"tool_choice names {name!r}, which is not in tools"
            )
        return ToolChoice.NAMED, name
    raise InvalidField(
        "tool_choice",
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
    )
