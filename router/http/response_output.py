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
                 response.reasoning_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta...,
                 response.function_call_arguments.done
    response.output_item.done; then response.completed (or
    response.incomplete when max_output_tokens cut it short).

Items come in the order the model wrote them (reasoning, text, calls); every
event has a ``sequence_number``. Streamed and whole, a request gets the same
items: the whole response is the stream's items.
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
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
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
        self.chat.add(index, response)

    def whole(self) -> dict:
        (choice,) = self.chat.whole()["choices"]
        message = choice["message"]
        pieces = [
            ("reasoning_content", message.get("reasoning_content")),
            ("content", message.get("content")),
        ]
        for key, text in pieces:
            if text:
                self._feed({key: text})
        for call in message.get("tool_calls") or ():
            self._feed({"tool_calls": [call]})
        self._close()
        self.finish_reason = choice["finish_reason"]
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
        for chunk in self.chat.chunks(index, response):
            for choice in chunk["choices"]:
                out.extend(self._feed(choice["delta"]))
                if choice["finish_reason"] is not None:
                    self.finish_reason = choice["finish_reason"]
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
        out.append(
            self._event(
                event,
                item_id=item.id,
                output_index=len(self.items) - 1,
                content_index=0,
                delta=text,
                **({"logprobs": []} if kind is ItemKind.MESSAGE else {}),
            )
        )
        return out

    def _open(self, kind: ItemKind, **fields) -> list[bytes]:
        out = self._close()
        item = _Item(kind, _id(kind.prefix), **fields)
        self.items.append(item)
        where = {"output_index": len(self.items) - 1}
        out.append(self._event("response.output_item.added", item=item.body(False), **where))
        if kind is not ItemKind.FUNCTION_CALL:
            where |= {"item_id": item.id, "content_index": 0}
            out.append(self._event("response.content_part.added", part=item.part(""), **where))
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
            message = item.kind is ItemKind.MESSAGE
            done = "response.output_text.done" if message else "response.reasoning_text.done"
            extra = {"logprobs": []} if message else {}
            out = [
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
