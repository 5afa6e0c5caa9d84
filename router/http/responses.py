"""OpenAI's Responses API request (``POST /v1/responses``) -> a chat completion request.

The Responses endpoint is a translation layer onto the chat path: its body
becomes a ChatCompletionRequest (router/http/schemas.py), which takes the one
request path (its template, tool plan, grammar, reasoning split), and the
chat output becomes Responses items and events (router/http/response_output.py).

Stateless: nothing is stored, so ``previous_response_id`` (and
``conversation``) are refused with 400; ``store: true`` is accepted and
nothing is stored all the same (docs/openai.md). Input items:

- messages (``{"role", "content"}``, ``type: "message"`` optional), their
  content a string or ``input_text`` / ``output_text`` parts;
- ``function_call`` items (the model's earlier calls, fed back): an assistant
  message's ``tool_calls`` (consecutive calls: one message);
- ``function_call_output`` items: a ``tool`` message naming the call;
- ``reasoning`` items: dropped (chat templates do not take earlier thoughts back).

``include: ["message.output_text.logprobs"]`` asks for the message's token
logprobs (chat's ``logprobs: true``), ``top_logprobs`` for that many
candidates per token (chat's ``top_logprobs``).

Errors name the Responses field (``tools.0.parameters``), not the chat one.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from router.http.schemas import ChatCompletionRequest
from router.http.structured import InvalidField

# Responses fields that ask for what a stateless server without hosted tools
# cannot do: refused with 400 naming them when they ask for something.
NOT_SUPPORTED = {
    "previous_response_id": "responses are not stored (store is not supported): "
    "send the whole conversation in input instead of previous_response_id",
    "conversation": "conversations are not stored: send the whole conversation in input",
    "background": "background responses are not supported (nothing is stored)",
    "prompt": "stored prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "context_management": "context_management is not supported",
    # vLLM's chat and completions extra: the Responses shape has no place for the ids.
    "return_token_ids": "return_token_ids is not supported on /v1/responses",
}
# What ``include`` may name: the one output a text model has to add.
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# OpenAI's bounds of top_logprobs.
MAX_TOP_LOGPROBS = 20
# Fields honoured at these values only (None passes too).
_ONLY = {"truncation": (("disabled",), "only truncation 'disabled' is supported")}
# Responses fields (taken here, never handed to the chat request as extras).
_OWN = frozenset(
    {*NOT_SUPPORTED, *_ONLY, "store", "metadata", "service_tier", "stream_options",
     "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"}
)  # fmt: skip
# Where a chat field's error points, in the Responses body's own names.
_PARAMS = [
    (re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"^tool_choice\.function\.name$"), "tool_choice.name"),
    (re.compile(r"^response_format\.json_schema\.(\w+)$"), r"text.format.\1"),
    (re.compile(r"^response_format(\.type)?$"), r"text.format\1"),
    (re.compile(r"^(max_tokens|max_completion_tokens)$"), "max_output_tokens"),
]


def responses_param(param: str | None) -> str | None:
    """A chat request's field (as an error names it) -> the Responses body's."""
    if param is None:
        return None
    for pattern, replacement in _PARAMS:
        if pattern.match(param):
            return pattern.sub(replacement, param)
    return param


class ResponsesRequest(BaseModel):
    # Unknown fields are kept: vLLM's extras (seed, top_k, structured_outputs,
    # cache_salt...) reach the chat request, which honours or refuses them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    stream: bool = False
    user: str | None = None

    @property
    def summary(self) -> bool:
        """``reasoning.summary`` asked: reasoning items carry their text as a summary too."""
        return bool((self.reasoning or {}).get("summary"))

    @property
    def logprobs(self) -> bool:
        """``include`` asks for the message's token logprobs."""
        return OUTPUT_LOGPROBS in (self.include or ())

    def echo(self) -> dict:
        """The request's fields that the response object repeats (OpenAI's)."""
        extra = self.model_extra or {}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": extra.get("metadata") or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": (self.reasoning or {}).get("summary")},
            "temperature": self.temperature,
            "text": {"format": (self.text or {}).get("format") or {"type": "text"}},
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": [_echo_tool(t) for t in self.tools or ()],
            "top_logprobs": self.top_logprobs,
            "top_p": self.top_p,
            "truncation": "disabled",
            "user": self.user,
        }

    def check(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if value is None or value is False or value in ("", [], {}, 0):
                continue
            if name in NOT_SUPPORTED:
                raise InvalidField(name, NOT_SUPPORTED[name])
            if name in _ONLY and value not in _ONLY[name][0]:
                raise InvalidField(name, _ONLY[name][1])
        self._check_logprobs()
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none"):
            raise InvalidField(
                "reasoning.effort", "reasoning.effort is not supported: the model decides"
            )

    def _check_logprobs(self) -> None:
        for i, name in enumerate(self.include or ()):
            if name != OUTPUT_LOGPROBS:
                raise InvalidField(
                    f"include.{i}",
                    f"include {name!r} is not supported: only {OUTPUT_LOGPROBS!r} "
                    "(the response carries everything else it has)",
                )
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidField("top_logprobs", f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if top and not self.logprobs:
            raise InvalidField("top_logprobs", f"top_logprobs needs include: [{OUTPUT_LOGPROBS!r}]")

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion request this one is (400 naming a Responses field)."""
        self.check()
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in _OWN}
        body: dict[str, Any] = {
            **extra,
            "model": self.model,
            "messages": self.messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "response_format": _response_format(self.text),
            "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs if self.logprobs else None,
        }
        if self.tools:
            body["tools"] = [_chat_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        return ChatCompletionRequest.model_validate(body)

    def messages(self) -> list[dict]:
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        names: dict[str, str] = {}  # call_id -> function name, for the tool messages
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                out.append(_message(i, item))
            elif kind == "function_call":
                _add_call(i, item, out, names)
            elif kind == "function_call_output":
                out.append(_call_output(i, item, names))
            elif kind != "reasoning":
                raise InvalidField(
                    f"input.{i}.type",
                    f"input items of type {kind!r} are not supported: use messages, "
                    "function_call and function_call_output items",
                )
        if not out:
            raise InvalidField("input", "input is empty")
        return out


def _text_of(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"input.{i}.content", "content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise InvalidField(
                f"input.{i}.content.{j}",
                f"content parts of type {kind!r} are not supported (this model reads text only)",
            )
        texts.append(part["text"])
    return "".join(texts)


def _message(i: int, item: dict) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidField(
            f"input.{i}.role", "a message's role must be user, system, developer or assistant"
        )
    return {"role": role, "content": _text_of(i, item.get("content", ""))}


def _add_call(i: int, item: dict, out: list[dict], names: dict[str, str]) -> None:
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise InvalidField(f"input.{i}", "a function_call item needs its call_id and name")
    names[call_id] = name
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": item.get("arguments") or "{}"},
    }
    last = out[-1] if out else None
    # Calls right after the assistant's text (or each other) are that one turn's.
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(i: int, item: dict, names: dict[str, str]) -> dict:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise InvalidField(f"input.{i}.call_id", "a function_call_output item needs its call_id")
    output = item.get("output", "")
    text = output if isinstance(output, str) else _text_of(i, output)
    return {"role": "tool", "tool_call_id": call_id, "name": names.get(call_id), "content": text}


def _response_format(text: dict | None) -> dict | None:
    """``text.format`` -> chat's ``response_format`` (same kinds, flat spelling)."""
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict):
        raise InvalidField("text.format", "text.format must be an object")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _chat_tool(i: int, tool: Any) -> dict:
    """A Responses function tool (flat) -> chat's ``{"type", "function": {...}}``."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidField(
            f"tools.{i}.type",
            f"tools of type {kind!r} are not supported: only function tools (no hosted tools)",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def _echo_tool(tool: dict) -> dict:
    """A function tool as the response object lists it (every field, null where unset)."""
    keys = ("type", "name", "description", "parameters", "strict")
    return {k: tool.get(k) for k in keys}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidField(
        "tool_choice",
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...} (hosted and allowed_tools choices are not supported)',
    )
