"""GenerateResponse messages -> OpenAI response bodies and stream chunks.

One Assembler per HTTP request: it numbers the choices (prompt i's completion j
is choice i * n + j, as OpenAI numbers a batch of prompts), keeps what a
non-streamed answer needs and sums the usage of every prompt.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from proto import pdserve_pb2

# json.dumps(obj, separators=(",", ":")) without building an encoder per call.
_compact = json.JSONEncoder(separators=(",", ":")).encode
_string = json.encoder.encode_basestring_ascii  # a JSON string, as _compact writes it

FINISH = {
    pdserve_pb2.FINISH_REASON_STOP: "stop",
    pdserve_pb2.FINISH_REASON_LENGTH: "length",
    pdserve_pb2.FINISH_REASON_ABORT: "abort",  # vLLM's word: OpenAI has none
}


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # chat: content entries; completions: tuples
    offset: int = 0  # completions' text_offset of the next token
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Assembler:
    def __init__(
        self, frontend, prefix, model, n, num_prompts, *, chat, echo=None, top_logprobs=0
    ) -> None:
        self.tokenizer = frontend.tokenizer
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = n
        self.chat = chat
        self.echo = echo  # completions: the prompt texts to prepend, by prompt
        # Chat's top_logprobs is exactly k long (OpenAI); the engine adds the
        # sampled token when it is not among the k best (completions keep it, as vLLM).
        self.top_logprobs = top_logprobs
        self.object = "chat.completion" if chat else "text_completion"
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self._head: str | None = None  # a stream chunk's encoded start (``_events``)

    # -- token texts -------------------------------------------------------

    def _token(self, token_id: int, top) -> str:
        for t in top:
            if t.token_id == token_id and t.text:
                return t.text
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _logprobs(self, choice: _Choice, delta: pdserve_pb2.Delta, record: bool):
        """This delta's logprobs in the endpoint's shape (None when none were asked)."""
        if not delta.logprobs:
            return None
        entries = []
        for lp in delta.logprobs:
            token = self._token(lp.token_id, lp.top)
            if self.chat:
                entries.append(
                    {
                        "token": token,
                        "logprob": lp.logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {
                                "token": (text := t.text or self._token(t.token_id, ())),
                                "logprob": t.logprob,
                                "bytes": list(text.encode()),
                            }
                            for t in sorted(lp.top, key=lambda t: -t.logprob)[: self.top_logprobs]
                        ],
                    }
                )
            else:
                top = {t.text or self._token(t.token_id, ()): t.logprob for t in lp.top}
                entries.append((token, lp.logprob, top, choice.offset))
                choice.offset += len(token)
        if record:
            choice.logprobs.extend(entries)
        return self._shape(entries)

    def _shape(self, entries: list):
        if self.chat:
            return {"content": entries}
        return {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries],
            "text_offset": [e[3] for e in entries],
        }

    def _final(self, index: int, final: pdserve_pb2.Final) -> list[int]:
        """Records how prompt ``index``'s completions ended; their choice numbers."""
        usage = final.usage
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cached_tokens += usage.cached_tokens
        ended = []
        for c in final.completions:
            number = index * self.n + c.index
            choice = self.choices[number]
            choice.finish_reason = FINISH.get(c.finish_reason)
            which = c.WhichOneof("stop_reason")
            choice.stop_reason = getattr(c, which) if which else None
            ended.append(number)
        return ended

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    # -- non-streamed ----------------------------------------------------------

    def add(self, index: int, response: pdserve_pb2.GenerateResponse) -> None:
        for delta in response.deltas:
            choice = self.choices[index * self.n + delta.index]
            choice.text.append(delta.text)
            self._logprobs(choice, delta, record=True)
        if response.HasField("final"):
            self._final(index, response.final)

    def whole(self) -> dict:
        choices = []
        for number, c in enumerate(self.choices):
            text = "".join(c.text)
            logprobs = self._shape(c.logprobs) if c.logprobs else None
            if self.chat:
                body = {"message": {"role": "assistant", "content": text}, "logprobs": logprobs}
            else:
                if self.echo is not None:
                    text = self.echo[number // self.n] + text
                body = {"text": text, "logprobs": logprobs}
            choices.append(
                {
                    "index": number,
                    **body,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return self._envelope(choices) | {"usage": self.usage()}

    # -- streamed ----------------------------------------------------------------
    #
    # Server-Sent Events are written as bytes here, one ``data: {...}`` event per
    # chunk, every chunk of one GenerateResponse in one buffer (one write to the
    # socket). Per streamed token this is the edge's own work, on the router's
    # one event loop beside every other stream
    # (docs/lab/2026-11-25-router-event-loop-sse.md), so the part of each chunk that never
    # changes -- id, object, created, model -- is encoded once per request, and
    # only the choice per token; the bytes are those of json.dumps(chunk) with
    # compact separators (tests/unit/router/test_openai_chunks.py checks).

    def _envelope(self, choices: list) -> dict:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choice: dict) -> dict:
        out = self._envelope([choice])
        if self.chat:
            out["object"] = "chat.completion.chunk"
        return out

    def _events(self, choices: list[dict | str]) -> bytes:
        if not choices:
            return b""
        if self._head is None:
            head = _compact(self._chunk({}) | {"choices": []})
            self._head = "data: " + head[: -len("]}")]  # up to '"choices":['
        head = self._head
        return "".join(
            [f"{head}{c if type(c) is str else _compact(c)}]}}\n\n" for c in choices]
        ).encode()

    def _start_choices(self) -> list[dict]:
        if self.chat:
            return [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(len(self.choices))
            ]
        if self.echo is None:
            return []
        return [
            {
                "index": i,
                "text": self.echo[i // self.n],
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(self.choices))
        ]

    def _choices(self, index: int, response, encoded: bool = False) -> list[dict | str]:
        """The response's choices; ``encoded``: token chunks as JSON text already."""
        out = []
        for delta in response.deltas:
            number = index * self.n + delta.index
            logprobs = self._logprobs(self.choices[number], delta, record=False)
            if not delta.text and not delta.token_ids and logprobs is None:
                continue  # nothing was generated in this message for this choice
            # A step's tokens always make a chunk, even with no text yet (half a
            # UTF-8 character held back, or no tokenizer at all): clients and load
            # generators time tokens by chunks, as they do against vLLM.
            if encoded and logprobs is None:
                # A token's chunk, the one per step: encoded without a dict (same bytes).
                text = _string(delta.text)
                body = f'"delta":{{"content":{text}}}' if self.chat else f'"text":{text}'
                out.append(f'{{"index":{number},{body},"logprobs":null,"finish_reason":null}}')
                continue
            body = {"delta": {"content": delta.text}} if self.chat else {"text": delta.text}
            out.append({"index": number, **body, "logprobs": logprobs, "finish_reason": None})
        if response.HasField("final"):
            for number in self._final(index, response.final):
                c = self.choices[number]
                body = {"delta": {}} if self.chat else {"text": ""}
                out.append(
                    {
                        "index": number,
                        **body,
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return out

    def start_chunks(self) -> list[dict]:
        """What comes before any token: chat's role, completions' echoed prompt."""
        return [self._chunk(c) for c in self._start_choices()]

    def start_events(self) -> bytes:
        return self._events(self._start_choices())

    def chunks(self, index: int, response: pdserve_pb2.GenerateResponse) -> list[dict]:
        return [self._chunk(c) for c in self._choices(index, response)]

    def events(self, index: int, response: pdserve_pb2.GenerateResponse) -> bytes:
        """``chunks``, as Server-Sent Events in one buffer (b"" when there are none)."""
        return self._events(self._choices(index, response, encoded=True))

    def usage_chunk(self) -> dict:
        out = self._envelope([]) | {"usage": self.usage()}
        if self.chat:
            out["object"] = "chat.completion.chunk"
        return out
