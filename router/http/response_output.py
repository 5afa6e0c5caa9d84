"""Chat output -> OpenAI's Responses object and its typed stream events.

The chat Assembler (router/http/chunks.py) does the work: tokens to text,
reasoning split, tool calls parsed. ResponsesAssembler wraps it and reshapes
what it makes: a whole chat message becomes output items; streamed chat
chunks become the Responses events, in OpenAI's order:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta...,
                 response.output_text.done, response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta...,
                 response.reasoning_text.done, response.content_part.done; with
                 ``reasoning.summary`` its summary too (the same text):
                 response.reasoning_summary_part.added before the content part,
                 a response.reasoning_summary_text.delta before each
                 reasoning_text delta, response.reasoning_summary_text.done and
                 response.reasoning_summary_part.done before reasoning_text.done
      function_call: response.function_call_arguments.delta...,
                 response.function_call_arguments.done
    response.output_item.done; then response.completed (or
    response.incomplete when max_output_tokens cut it short).

Items come in the order the model wrote them (reasoning, text, calls); every
event has a ``sequence_number``. Streamed and whole, a request gets the same
items: a whole response is built by the stream's own steps (its events unsent).

Logprobs (``include: ["message.output_text.logprobs"]``) belong to the
message's text: a step's tokens go to the output_text delta its text makes;
tokens whose text is held back (a tag not yet complete) wait for the next
step's; tokens that wrote only reasoning or a call's text are not the
message's and are dropped. A step that wrote both reasoning and text is text.
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi.sse import format_sse_event

from router.http.chunks import Assembler
from router.http.responses import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# A generation the server aborted (finish_reason "abort" on the chat path).
_ABORTED = {"code": "server_error", "message": "the server aborted the generation"}


class Status(enum.Enum):
    """A response's life cycle (OpenAI's ``status``; the last event is ``response.<status>``)."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # max_output_tokens reached
    FAILED = "failed"


class ItemKind(enum.Enum):
    """An output item's type (OpenAI's names), and its id's prefix."""

    MESSAGE = "message"
    REASONING = "reasoning"
    FUNCTION_CALL = "function_call"

    @property
    def prefix(self) -> str:
        return {"message": "msg", "reasoning": "rs", "function_call": "fc"}[self.value]


@dataclass(slots=True)
class _Item:
    """One output item as it grows: a message, a reasoning item or a call."""

    kind: ItemKind
    id: str
    text: list[str] = field(default_factory=list)  # output text / reasoning / arguments
    call_id: str = ""
    name: str = ""
    done: bool = False
    # A message's token logprobs (OpenAI's output_text.logprobs entries).
    logprobs: list[dict] = field(default_factory=list)

    def body(self, summary: bool) -> dict:
        status = "completed" if self.done else "in_progress"
        text = "".join(self.text)
        if self.kind is ItemKind.FUNCTION_CALL:
            return {
                "type": "function_call",
                "id": self.id,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": text,
                "status": status,
            }
        parts = [self.part(text)] if self.done else []
        if self.kind is ItemKind.MESSAGE:
            return {
                "type": "message",
                "id": self.id,
                "role": "assistant",
                "status": status,
                "content": parts,
            }
        summaries = [{"type": "summary_text", "text": text}] if summary and self.done else []
        return {
            "type": "reasoning",
            "id": self.id,
            "summary": summaries,
            "content": parts,
            "status": status,
        }

    def part(self, text: str) -> dict:
        if self.kind is ItemKind.MESSAGE:
            return {
                "type": "output_text",
                "text": text,
                "annotations": [],
                "logprobs": self.logprobs if text else [],
            }
        return {"type": "reasoning_text", "text": text}


class ResponsesAssembler:
    """The chat Assembler's output as a Responses object or its events (the
    interface router/http/app.py's ``run`` drives: add/whole, *_events)."""

    def __init__(self, chat: Assembler, request: ResponsesRequest, echo: dict) -> None:
        self.chat = chat
        self.request = request
        self.echo = echo  # the request's fields the response object repeats
        self.id = _id("resp")
        self.created = time.time()
        self.items: list[_Item] = []
        self.finish_reason: str | None = None
        self.sequence = 0
        # Logprobs of tokens whose text is held back, for the next output_text delta.
        self.pending: list[dict] = []

    # -- the Response object ---------------------------------------------------

    def response(self, status: Status) -> dict:
        chat = self.chat
        incomplete = {"reason": "max_output_tokens"} if status is Status.INCOMPLETE else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": chat.model,
            "status": status.value,
            "error": _ABORTED if status is Status.FAILED else None,
            "incomplete_details": incomplete,
            "output": [i.body(self.request.summary) for i in self.items],
            "usage": {
                "input_tokens": chat.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": chat.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": chat.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat.prompt_tokens + chat.completion_tokens,
            }
            if status is not Status.IN_PROGRESS
            else None,
            "store": False,
            **self.echo,
        }

    def status(self) -> Status:
        if self.finish_reason == "abort":  # the engine ended it (its error is in the logs)
            return Status.FAILED
        return Status.INCOMPLETE if self.finish_reason == "length" else Status.COMPLETED

    # -- non-streamed ------------------------------------------------------------

    def add(self, index: int, response) -> None:
        self.events(index, response)  # the stream's steps: the same items, unsent

    def whole(self) -> dict:
        self._close()
        return self.response(self.status())

    # -- streamed -----------------------------------------------------------------

    def _event(self, kind: str, **body) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        return format_sse_event(event=kind, data_str=json.dumps(body, separators=(",", ":")))

    def start_events(self) -> bytes:
        created = self.response(Status.IN_PROGRESS)
        return self._event("response.created", response=created) + self._event(
            "response.in_progress", response=created
        )

    def events(self, index: int, response) -> bytes:
        out: list[bytes] = []
        for step in _steps(self.chat.chunks(index, response)):
            deltas = [choice["delta"] for choice in step]
            for choice in step:
                if (logprobs := choice["logprobs"]) is not None:
                    self.pending.extend(logprobs["content"])
                if choice["finish_reason"] is not None:
                    self.finish_reason = choice["finish_reason"]
            other = any(d.get("reasoning_content") or d.get("tool_calls") for d in deltas)
            if other and not any(d.get("content") for d in deltas):
                self.pending.clear()  # reasoning or a call's text: not the message's
            for delta in deltas:
                out.extend(self._feed(delta))
        return b"".join(out)

    def end_events(self, _include_usage: bool) -> bytes:
        status = self.status()
        closing = self._close()
        return b"".join(
            [*closing, self._event(f"response.{status.value}", response=self.response(status))]
        )

    def error_events(self, error: dict) -> bytes:
        e = error["error"]
        # The Response's error codes are OpenAI's few; a refusal by load is one of them.
        code = "rate_limit_exceeded" if e["code"] == "rate_limit_exceeded" else "server_error"
        failed = self.response(Status.FAILED) | {"error": {"code": code, "message": e["message"]}}
        return self._event(
            "error", code=e["code"], message=e["message"], param=e["param"]
        ) + self._event("response.failed", response=failed)

    # -- items ---------------------------------------------------------------------

    def _feed(self, delta: dict) -> list[bytes]:
        """One chat delta -> the events it makes (opening and closing items)."""
        out: list[bytes] = []
        if text := delta.get("reasoning_content"):
            out += self._text(ItemKind.REASONING, text, "response.reasoning_text.delta")
        if text := delta.get("content"):
            out += self._text(ItemKind.MESSAGE, text, "response.output_text.delta")
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a new call
                function = call["function"]
                out += self._open(ItemKind.FUNCTION_CALL, call_id=call["id"], name=function["name"])
            if args := call["function"].get("arguments"):
                item = self.items[-1]
                item.text.append(args)
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=len(self.items) - 1,
                        delta=args,
                    )
                )
        return out

    def _text(self, kind: ItemKind, text: str, event: str) -> list[bytes]:
        out = []
        if not self.items or self.items[-1].kind != kind or self.items[-1].done:
            out += self._open(kind)
        item = self.items[-1]
        item.text.append(text)
        where = {"item_id": item.id, "output_index": len(self.items) - 1}
        extra = {}
        if kind is ItemKind.MESSAGE:
            logprobs, self.pending = self.pending, []
            item.logprobs += logprobs
            extra = {"logprobs": [_event_logprob(e) for e in logprobs]}
        elif self.request.summary:
            out.append(
                self._event(
                    "response.reasoning_summary_text.delta", summary_index=0, delta=text, **where
                )
            )
        out.append(self._event(event, content_index=0, delta=text, **extra, **where))
        return out

    def _open(self, kind: ItemKind, **fields) -> list[bytes]:
        out = self._close()
        item = _Item(kind, _id(kind.prefix), **fields)
        self.items.append(item)
        where = {"output_index": len(self.items) - 1}
        out.append(self._event("response.output_item.added", item=item.body(False), **where))
        if kind is ItemKind.FUNCTION_CALL:
            return out
        where |= {"item_id": item.id}
        if kind is ItemKind.REASONING and self.request.summary:
            out.append(
                self._event(
                    "response.reasoning_summary_part.added",
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                    **where,
                )
            )
        out.append(
            self._event("response.content_part.added", content_index=0, part=item.part(""), **where)
        )
        return out

    def _close(self) -> list[bytes]:
        """The last item's closing events (none when it is closed already)."""
        if not self.items or self.items[-1].done:
            return []
        item = self.items[-1]
        item.done = True
        text = "".join(item.text)
        where = {"item_id": item.id, "output_index": len(self.items) - 1}
        if item.kind is ItemKind.FUNCTION_CALL:
            out = [
                self._event(
                    "response.function_call_arguments.done", name=item.name, arguments=text, **where
                )
            ]
        else:
            out = self._summary_done(item, text, where)
            message = item.kind is ItemKind.MESSAGE
            done = "response.output_text.done" if message else "response.reasoning_text.done"
            extra = {"logprobs": [_event_logprob(e) for e in item.logprobs]} if message else {}
            out += [
                self._event(done, content_index=0, text=text, **extra, **where),
                self._event(
                    "response.content_part.done", content_index=0, part=item.part(text), **where
                ),
            ]
        body = item.body(self.request.summary)
        out.append(
            self._event("response.output_item.done", item=body, output_index=where["output_index"])
        )
        return out

    def _summary_done(self, item: _Item, text: str, where: dict) -> list[bytes]:
        """A reasoning item's summary closing events (with ``reasoning.summary``)."""
        if item.kind is not ItemKind.REASONING or not self.request.summary:
            return []
        part = {"type": "summary_text", "text": text}
        return [
            self._event(
                "response.reasoning_summary_text.done", summary_index=0, text=text, **where
            ),
            self._event(
                "response.reasoning_summary_part.done", summary_index=0, part=part, **where
            ),
        ]


def _steps(chunks: list[dict]) -> list[list[dict]]:
    """The chat chunks' choices grouped by engine step: a step's first chunk
    carries its tokens' logprobs (router/http/chunks.py), the chunks after it
    with none (its text's further pieces, the finish) belong to it."""
    steps: list[list[dict]] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["logprobs"] is not None or not steps:
                steps.append([choice])
            else:
                steps[-1].append(choice)
    return steps


def _event_logprob(entry: dict) -> dict:
    """A chat logprobs entry as the stream events carry it (OpenAI's event type has no bytes)."""
    top = [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]
    return {"token": entry["token"], "logprob": entry["logprob"], "top_logprobs": top}
