"""Tool calls found in a model's output text, piece by piece (streamed) or whole.

Every parser takes the output in pieces (``feed``) and at its end
(``finish``) and gives events: ``("content", text)``, ``("call", name,
arguments)`` (one whole call, its arguments as JSON text), or, for a call
streamed as it is generated, ``("call_start", name)`` then ``("args",
text)`` pieces. A whole answer is its stream's events joined, so the two
never disagree.

``--tool-call-parser`` picks the model family's format for tool_choice auto:
- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` blocks, text before them is content;
- ``llama3_json`` (Llama 3.1-3.3): an output that is a JSON object
  ``{"name": ..., "parameters": {...}}`` (several joined by ``;``), optionally
  after ``<|python_tag|>``.
tool_choice required and named are parsed here too, whatever the family: their
grammar makes the output JSON (router/http/tools.py).
"""

from __future__ import annotations

import json

from router.http.text_scan import TagScanner

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_decoder = json.JSONDecoder()


def call_of(obj: object, args_key: str = "arguments") -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesParser:
    """``<tool_call>...</tool_call>`` blocks; each is emitted once it closes."""

    __slots__ = ("body", "calls", "in_call", "open", "parallel")

    def __init__(self, parallel: bool = True) -> None:
        self.open = TagScanner("<tool_call>")
        self.body = ""
        self.in_call = False
        self.parallel = parallel
        self.calls = 0

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        while text:
            if not self.in_call:
                before, found = self.open.feed(text)
                if before:
                    out.append(("content", before))
                text, self.in_call = (self.open.rest, True) if found else ("", False)
            else:
                # A call's body is held whole: half of its JSON is no call yet.
                self.body += text
                end = self.body.find("</tool_call>")
                if end < 0:
                    return out
                out.append(self._block(self.body[:end]))
                text = self.body[end + len("</tool_call>") :]
                self.in_call, self.body = False, ""
        return out

    def _block(self, body: str) -> tuple:
        try:
            call = call_of(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            return ("content", f"<tool_call>{body}</tool_call>")
        self.calls += 1
        if self.calls > 1 and not self.parallel:
            return ("content", "")  # parallel_tool_calls false: the first call only
        return ("call", *call)

    def finish(self) -> list[tuple]:
        if self.in_call:  # the output ended inside a block: a call if it parses
            self.in_call, body = False, self.body
            event = self._block(body)
            return [event] if event[0] == "call" else [("content", "<tool_call>" + body)]
        rest = self.open.flush()
        return [("content", rest)] if rest else []


class Llama3JsonParser:
    """An output that opens with ``{`` (after ``<|python_tag|>``) is calls;
    it is held whole (a half object is no call) and parsed at the end."""

    __slots__ = ("decided", "head", "is_call", "parallel")

    def __init__(self, parallel: bool = True) -> None:
        self.head = ""
        self.decided = False
        self.is_call = False
        self.parallel = parallel

    def feed(self, text: str) -> list[tuple]:
        if self.decided and not self.is_call:
            return [("content", text)] if text else []
        self.head += text
        if self.decided:
            return []
        stripped = self.head.lstrip().removeprefix("<|python_tag|>").lstrip()
        if not stripped or "<|python_tag|>".startswith(stripped):
            return []
        self.decided = True
        self.is_call = stripped.startswith("{")
        return [] if self.is_call else [("content", self.head)]

    def finish(self) -> list[tuple]:
        if self.decided and not self.is_call:
            return []
        text = self.head.lstrip().removeprefix("<|python_tag|>").strip()
        calls = _json_calls(text, ";", "parameters")
        if calls is None:
            return [("content", self.head)] if self.head else []
        return [("call", *c) for c in (calls if self.parallel else calls[:1])]


def _json_calls(text: str, sep: str, args_key: str) -> list[tuple[str, str]] | None:
    """Objects joined by ``sep``, each a call; None if any is not."""
    calls, i = [], 0
    while i < len(text):
        try:
            obj, i = _decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = call_of(obj, args_key)
        if call is None:
            return None
        calls.append(call)
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
    return calls or None


class RequiredCalls:
    """tool_choice required: the output is a JSON array of ``{"name",
    "parameters"}`` (the grammar's); held and parsed at the end."""

    __slots__ = ("text",)

    def __init__(self) -> None:
        self.text = ""

    def feed(self, text: str) -> list[tuple]:
        self.text += text
        return []

    def finish(self) -> list[tuple]:
        try:
            items = json.loads(self.text)
        except ValueError:
            items = None  # cut short (max_tokens): what was generated, as text
        calls = [call_of(i, "parameters") for i in items] if isinstance(items, list) else [None]
        if not calls or None in calls:
            return [("content", self.text)] if self.text else []
        return [("call", *c) for c in calls]


class NamedCall:
    """tool_choice naming a function: the output is its arguments, streamed."""

    __slots__ = ("name", "started")

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        if not self.started:
            self.started = True
            out.append(("call_start", self.name))
        if text:
            out.append(("args", text))
        return out

    def finish(self) -> list[tuple]:
        return self.feed("") if not self.started else []


def make_parser(name: str, parallel: bool):
    if name == "hermes":
        return HermesParser(parallel)
    if name == "llama3_json":
        return Llama3JsonParser(parallel)
    raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
