"""Reasoning on the gRPC API: with the router's --reasoning-parser, a chat
request's output is split as the HTTP API splits it (router/http/reasoning.py).

Each Delta's ``text`` keeps the answer's part and ``reasoning_text`` gets the
thinking's; the ``<think>`` tags are in neither, and within one delta the
reasoning comes first (a thought always precedes its answer). Text held back
while a tag may still complete comes with a later delta; what is held at the
end comes in the Final's message, in that completion's delta (added, without
token ids, where the message had none). The tool calls (router/tool_calls.py)
are then looked for in the answer alone, as on the HTTP API.
"""

from __future__ import annotations

from proto import pdserve_pb2
from router.http.reasoning import ReasoningSplitter


class ReasoningOutput:
    """One gRPC request's completions, each split by its own splitter."""

    __slots__ = ("splitters",)

    def __init__(self) -> None:
        self.splitters: dict[int, ReasoningSplitter] = {}

    @classmethod
    def of(cls, request: pdserve_pb2.GenerateRequest, parser: str | None) -> ReasoningOutput | None:
        """None where nothing is split: no --reasoning-parser, or not a chat
        request (a raw prompt's output is the client's, as on /v1/completions)."""
        if parser is None or request.WhichOneof("input") != "chat":
            return None
        return cls()

    def observe(self, response: pdserve_pb2.GenerateResponse) -> None:
        """Splits the message's deltas in place; on the Final, flushes what was held."""
        for delta in response.deltas:
            splitter = self.splitters.get(delta.index)
            if splitter is None:
                splitter = self.splitters[delta.index] = ReasoningSplitter()
            text, delta.text = delta.text, ""
            _append(delta, splitter.feed(text))
        if not response.HasField("final"):
            return
        for completion in response.final.completions:
            splitter = self.splitters.pop(completion.index, None)
            pieces = splitter.finish() if splitter is not None else []
            if not pieces:
                continue
            delta = next((d for d in response.deltas if d.index == completion.index), None)
            if delta is None:
                delta = response.deltas.add(index=completion.index)
            _append(delta, pieces)


def _append(delta: pdserve_pb2.Delta, pieces: list[tuple[str, str]]) -> None:
    for kind, text in pieces:
        if kind == "reasoning":
            delta.reasoning_text += text
        else:
            delta.text += text
