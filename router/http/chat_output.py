"""A chat choice's text -> OpenAI's message: ``content``, ``reasoning_content``
and ``tool_calls``, streamed as deltas or whole.

The text goes through the reasoning parser (if the server has one), then its
answer part through the tool-call parser the request's tool_choice calls for
(router/http/tool_parsers.py). A whole message is the stream's deltas joined:
streamed and not, a request gets the same calls, content and reasoning.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from router.http.reasoning import ReasoningSplitter
from router.http.tool_parsers import NamedCall, RequiredCalls, make_parser
from router.http.tools import ToolChoice, ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class OutputPlan:
    """What a chat request's output goes through (None of it: plain content)."""

    reasoning: bool = False
    tools: ToolPlan | None = None
    tool_parser: str | None = None
    # The field that asked for the output's grammar (response_format,
    # guided_json, tool_choice...): a refused spec's 400 names it.
    constraint_param: str | None = None

    @property
    def active(self) -> bool:
        return self.reasoning or (
            self.tools is not None and self.tools.choice is not ToolChoice.NONE
        )

    def new_choice(self) -> ChoiceOutput:
        calls = None
        tools = self.tools
        if tools is not None:
            if tools.choice is ToolChoice.REQUIRED:
                calls = RequiredCalls()
            elif tools.choice is ToolChoice.NAMED:
                calls = NamedCall(tools.named)
            elif tools.choice is ToolChoice.AUTO and self.tool_parser is not None:
                calls = make_parser(self.tool_parser, tools.parallel)
        return ChoiceOutput(
            ReasoningSplitter() if self.reasoning else None, calls, tools is not None
        )


@dataclass(slots=True)
class ChoiceOutput:
    reasoning_parser: ReasoningSplitter | None
    calls_parser: object | None
    has_tools: bool
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[dict]:
        """The deltas (OpenAI's ``delta`` objects) this piece of text makes."""
        if not text:
            return []
        pieces = self.reasoning_parser.feed(text) if self.reasoning_parser else [("content", text)]
        return self._deltas(pieces, final=False)

    def finish(self) -> list[dict]:
        """What was held back (a possible tag, a call not yet closed)."""
        pieces = self.reasoning_parser.finish() if self.reasoning_parser else []
        return self._deltas(pieces, final=True)

    def _deltas(self, pieces: list[tuple[str, str]], final: bool) -> list[dict]:
        out: list[dict] = []
        for kind, text in pieces:
            if kind == "reasoning":
                self.reasoning.append(text)
                out.append({"reasoning_content": text})
            elif self.calls_parser is None:
                self._content(text, out)
            else:
                self._events(self.calls_parser.feed(text), out)
        if final and self.calls_parser is not None:
            self._events(self.calls_parser.finish(), out)
        return out

    def _content(self, text: str, out: list[dict]) -> None:
        if text:
            self.content.append(text)
            out.append({"content": text})

    def _events(self, events: list[tuple], out: list[dict]) -> None:
        for event in events:
            kind = event[0]
            if kind == "content":
                self._content(event[1], out)
            elif kind in ("call", "call_start"):
                name, args = event[1], event[2] if kind == "call" else ""
                call = {
                    "index": len(self.calls),
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": args},
                }
                self.calls.append(call)
                out.append({"tool_calls": [dict(call, function=dict(call["function"]))]})
            else:  # "args": more of the last call's arguments
                last = self.calls[-1]
                last["function"]["arguments"] += event[1]
                out.append(
                    {"tool_calls": [{"index": last["index"], "function": {"arguments": event[1]}}]}
                )

    def message(self) -> dict:
        """The whole message (after every ``feed`` and the ``finish``)."""
        content: str | None = "".join(self.content)
        if self.calls and not content.strip():
            content = None  # OpenAI's null content beside tool calls
        msg: dict = {"role": "assistant", "content": content}
        if self.reasoning_parser is not None:
            msg["reasoning_content"] = "".join(self.reasoning) or None
        if self.has_tools:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
