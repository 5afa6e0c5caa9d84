"""GenerateResponse messages -> OpenAI response bodies and stream chunks.

One Assembler per HTTP request: it numbers the choices (prompt i's completion j
is choice i * n + j, as OpenAI numbers a batch of prompts), keeps what a
non-streamed answer needs and sums the usage of every prompt.

Prompt logprobs (the first message of a prompt carries them) become, with
completions' ``echo`` and ``logprobs``, the echoed prompt's entries of OpenAI's
legacy ``logprobs``: the prompt's first token has no context, so its
``token_logprobs`` and ``top_logprobs`` entries are null (as vLLM and OpenAI);
``text_offset`` runs on through the generated tokens. vLLM's ``prompt_logprobs``
extra gets them in vLLM's own shape.

vLLM's ``return_token_ids`` extra puts the token ids where vLLM does: each
choice's ``token_ids`` (streamed: that chunk's new ids, so every choice chunk
has the key), and the prompt's ids as ``prompt_token_ids`` -- completions: on
the choice (streamed: its first chunk only); chat: on the response (streamed:
the role chunks only).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi.sse import format_sse_event

from proto import pdserve_pb2
from router.http.chat_output import OutputPlan

# json.dumps(obj, separators=(",", ":")) without building an encoder per call.
_compact = json.JSONEncoder(separators=(",", ":")).encode
_string = json.encoder.encode_basestring_ascii  # a JSON string, as _compact writes it

DONE = format_sse_event(data_str="[DONE]")
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
    token_ids: list[int] = field(default_factory=list)  # with return_token_ids


@dataclass(slots=True)
class EchoLogprobs:
    """Completions' echo with logprobs: per prompt, its first token (which has
    no logprob, so the first message's prompt logprobs do not name it)."""

    first_tokens: list[int]


class Assembler:
    def __init__(
        self,
        frontend,
        prefix,
        model,
        n,
        num_prompts,
        *,
        chat,
        echo=None,
        top_logprobs=0,
        echo_logprobs: EchoLogprobs | None = None,
        echo_only: bool = False,
        prompt_logprobs: bool = False,
        output: OutputPlan | None = None,
        prompt_ids: list[list[int]] | None = None,
    ) -> None:
        self.tokenizer = frontend.tokenizer
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = n
        self.chat = chat
        self.echo = echo  # completions: the prompt texts to prepend, by prompt
        self.echo_logprobs = echo_logprobs
        # echo with max_tokens 0: only the prompt; nothing generated is shown or counted.
        self.echo_only = echo_only
        # vLLM's prompt_logprobs extra: by prompt, [None, {token id: entry}, ...].
        self.prompt_logprobs: dict[int, list] | None = {} if prompt_logprobs else None
        self._seen: set[int] = set()  # prompts whose first message came
        # Chat's top_logprobs is exactly k long (OpenAI); the engine adds the
        # sampled token when it is not among the k best (completions keep it, as vLLM).
        self.top_logprobs = top_logprobs
        self.object = "chat.completion" if chat else "text_completion"
        self.choices = [_Choice() for _ in range(n * num_prompts)]
        # Chat with a reasoning parser or tools: each choice's text is split
        # into content, reasoning and tool calls (router/http/chat_output.py).
        self.outputs = (
            [output.new_choice() for _ in self.choices] if output and output.active else None
        )
        # vLLM's return_token_ids: by prompt, its token ids (filled by the
        # router's request path before its first message); None: not asked.
        self.prompt_ids = prompt_ids
        self._ids_sent: set[int] = set()  # completions' choices whose prompt ids went out
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

    def _prompt_entries(self, index: int, response) -> list:
        """The echoed prompt's completions entries (tuples, as ``_logprobs``)."""
        first = self.echo_logprobs.first_tokens[index]
        token = self._token(first, ())
        entries, offset = [(token, None, None, 0)], len(token)
        for lp in response.prompt_logprobs:
            token = self._token(lp.token_id, lp.top)
            top = {t.text or self._token(t.token_id, ()): t.logprob for t in lp.top}
            entries.append((token, lp.logprob, top, offset))
            offset += len(token)
        return entries

    def _first_message(self, index: int, response) -> list[dict]:
        """What a prompt's first message brings before its tokens: its prompt
        logprobs; with echo and logprobs, its echo chunks (streamed)."""
        if index in self._seen:
            return []
        self._seen.add(index)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[index] = [None, *map(_vllm_entry, response.prompt_logprobs)]
        if self.echo_logprobs is None:
            return []
        entries = self._prompt_entries(index, response)
        chunks = []
        for number in range(index * self.n, (index + 1) * self.n):
            choice = self.choices[number]
            choice.logprobs[:0] = entries
            choice.offset = entries[-1][3] + len(entries[-1][0])
            text = self.echo[index]
            logprobs = self._shape(entries)
            chunk = {"index": number, "text": text, "logprobs": logprobs, "finish_reason": None}
            chunks.append(self._with_ids(chunk, ()))
        return chunks

    def _with_ids(self, chunk: dict, token_ids) -> dict:
        """A choice chunk with vLLM's return_token_ids fields, when asked: its
        new token ids; a completion's first chunk, its prompt's ids too."""
        if self.prompt_ids is None:
            return chunk
        chunk["token_ids"] = list(token_ids)
        number = chunk["index"]
        if not self.chat and number not in self._ids_sent:
            self._ids_sent.add(number)
            chunk["prompt_token_ids"] = self.prompt_ids[number // self.n]
        return chunk

    def _final(self, index: int, final: pdserve_pb2.Final) -> list[int]:
        """Records how prompt ``index``'s completions ended; their choice numbers."""
        usage = final.usage
        self.prompt_tokens += usage.prompt_tokens
        if not self.echo_only:
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
        self._first_message(index, response)
        for delta in response.deltas if not self.echo_only else ():
            choice = self.choices[index * self.n + delta.index]
            choice.text.append(delta.text)
            self._logprobs(choice, delta, record=True)
            if self.prompt_ids is not None:
                choice.token_ids.extend(delta.token_ids)
        if response.HasField("final"):
            self._final(index, response.final)

    def whole(self) -> dict:
        choices = []
        for number, c in enumerate(self.choices):
            text = "".join(c.text)
            logprobs = self._shape(c.logprobs) if c.logprobs else None
            finish_reason = c.finish_reason
            if self.outputs is not None:
                out = self.outputs[number]
                out.feed(text)
                out.finish()
                body = {"message": out.message(), "logprobs": logprobs}
                finish_reason = out.finish_reason(finish_reason)
            elif self.chat:
                body = {"message": {"role": "assistant", "content": text}, "logprobs": logprobs}
            else:
                if self.echo is not None:
                    text = self.echo[number // self.n] + text
                body = {"text": text, "logprobs": logprobs}
                if self.prompt_logprobs is not None:
                    body["prompt_logprobs"] = self.prompt_logprobs.get(number // self.n)
                if self.prompt_ids is not None:
                    body["prompt_token_ids"] = self.prompt_ids[number // self.n]
            choice = {
                "index": number,
                **body,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
            if self.prompt_ids is not None:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        out = self._envelope(choices) | {"usage": self.usage()}
        if self.chat and self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs.get(0)  # vLLM's place for chat
        if self.chat and self.prompt_ids is not None:
            out["prompt_token_ids"] = self.prompt_ids[0]  # vLLM's place for chat
        return out

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
        if self.echo is None or self.echo_logprobs is not None:
            return []  # with logprobs, the echo waits for the prompt's logprobs
        return [
            self._with_ids(
                {
                    "index": i,
                    "text": self.echo[i // self.n],
                    "logprobs": None,
                    "finish_reason": None,
                },
                (),
            )
            for i in range(len(self.choices))
        ]

    def _choices(self, index: int, response, encoded: bool = False) -> list[dict | str]:
        """The response's choices; ``encoded``: token chunks as JSON text already."""
        out: list[dict | str] = list(self._first_message(index, response))
        for delta in response.deltas if not self.echo_only else ():
            number = index * self.n + delta.index
            logprobs = self._logprobs(self.choices[number], delta, record=False)
            if not delta.text and not delta.token_ids and logprobs is None:
                continue  # nothing was generated in this message for this choice
            if self.outputs is not None:
                out.extend(self._parsed(number, delta, logprobs))
                continue
            # A step's tokens always make a chunk, even with no text yet (half a
            # UTF-8 character held back, or no tokenizer at all): clients and load
            # generators time tokens by chunks, as they do against vLLM.
            if encoded and logprobs is None and self.prompt_ids is None:
                # A token's chunk, the one per step: encoded without a dict (same bytes).
                text = _string(delta.text)
                body = f'"delta":{{"content":{text}}}' if self.chat else f'"text":{text}'
                out.append(f'{{"index":{number},{body},"logprobs":null,"finish_reason":null}}')
                continue
            body = {"delta": {"content": delta.text}} if self.chat else {"text": delta.text}
            chunk = {"index": number, **body, "logprobs": logprobs, "finish_reason": None}
            out.append(self._with_ids(chunk, delta.token_ids))
        if response.HasField("final"):
            for number in self._final(index, response.final):
                c = self.choices[number]
                body = {"delta": {}} if self.chat else {"text": ""}
                finish_reason = c.finish_reason
                if self.outputs is not None:
                    parsed = self.outputs[number]
                    out.extend(self._parsed_chunks(number, parsed.finish(), None))
                    finish_reason = parsed.finish_reason(finish_reason)
                chunk = {
                    "index": number,
                    **body,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
                out.append(self._with_ids(chunk, ()))
        return out

    def _parsed(self, number: int, delta: pdserve_pb2.Delta, logprobs) -> list[dict]:
        """A chat delta's text as parsed deltas (content, reasoning, tool calls)."""
        deltas = self.outputs[number].feed(delta.text)
        return self._parsed_chunks(number, deltas, logprobs, delta.token_ids)

    def _parsed_chunks(self, number: int, deltas: list[dict], logprobs, token_ids=()) -> list[dict]:
        wanted_ids = self.prompt_ids is not None and len(token_ids) > 0
        if not deltas and (logprobs is not None or wanted_ids):
            # The tokens' logprobs or ids still go out (their text is held back).
            deltas = [{}]
        return [
            self._with_ids(
                {
                    "index": number,
                    "delta": d,
                    "logprobs": logprobs if i == 0 else None,
                    "finish_reason": None,
                },
                token_ids if i == 0 else (),
            )
            for i, d in enumerate(deltas)
        ]

    def start_chunks(self) -> list[dict]:
        """What comes before any token: chat's role, completions' echoed prompt."""
        return [self._start_chunk(c) for c in self._start_choices()]

    def _start_chunk(self, choice: dict) -> dict:
        chunk = self._chunk(choice)
        if self.chat and self.prompt_ids is not None:
            chunk["prompt_token_ids"] = self.prompt_ids[0]  # vLLM's: on each role chunk
        return chunk

    def start_events(self) -> bytes:
        choices = self._start_choices()
        if self.chat and self.prompt_ids is not None:
            # The prompt's ids sit beside the choices, past the shared head (``_events``).
            return b"".join(
                format_sse_event(data_str=_compact(self._start_chunk(c))) for c in choices
            )
        return self._events(choices)

    def chunks(self, index: int, response: pdserve_pb2.GenerateResponse) -> list[dict]:
        return [self._chunk(c) for c in self._choices(index, response)]

    def events(self, index: int, response: pdserve_pb2.GenerateResponse) -> bytes:
        """``chunks``, as Server-Sent Events in one buffer (b"" when there are none)."""
        return self._events(self._choices(index, response, encoded=True))

    def end_events(self, include_usage: bool) -> bytes:
        """What follows the last token: the usage chunk (stream_options), then [DONE]."""
        usage = format_sse_event(data_str=_compact(self.usage_chunk())) if include_usage else b""
        return usage + DONE

    @staticmethod
    def error_events(error: dict) -> bytes:
        """A failure mid-stream (the status line is sent already): OpenAI's error object."""
        return format_sse_event(data_str=_compact(error)) + DONE

    def usage_chunk(self) -> dict:
        out = self._envelope([]) | {"usage": self.usage()}
        if self.chat:
            out["object"] = "chat.completion.chunk"
        return out


def _vllm_entry(lp: pdserve_pb2.TokenLogprobs) -> dict:
    """One prompt position in vLLM's prompt_logprobs shape: token id (a JSON
    key, so a string) -> logprob, rank (1 = best) and decoded token; the
    prompt's token and the best candidates."""
    out = {}
    for rank, t in enumerate(lp.top, 1):
        own = t.token_id == lp.token_id
        out[str(t.token_id)] = {
            "logprob": t.logprob,
            "rank": lp.rank if own else rank,
            "decoded_token": t.text,
        }
    if str(lp.token_id) not in out:
        out[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": None}
    return out
