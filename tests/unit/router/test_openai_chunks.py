"""The OpenAI stream's chunks: every step that generated tokens makes a chunk."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from proto import pdserve_pb2
from router.http.chunks import Assembler


def test_tokens_without_text_still_make_a_chunk():
    # No tokenizer (token ids in and out), or half a UTF-8 character held back:
    # the step's tokens still reach the client as a chunk, so TTFT and ITL are
    # measurable the way they are against vLLM.
    asm = Assembler(SimpleNamespace(tokenizer=None), "cmpl", "m", 1, 1, chat=False)
    step = pdserve_pb2.GenerateResponse()
    step.deltas.add(index=0, text="", token_ids=[17])
    chunks = asm.chunks(0, step)
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == ""
    # A message that carried nothing for the choice makes no chunk.
    assert asm.chunks(0, pdserve_pb2.GenerateResponse()) == []


def _old_event(chunk: dict) -> bytes:
    """What the edge wrote per chunk before events(): json.dumps, one SSE event."""
    from fastapi.sse import format_sse_event

    return format_sse_event(data_str=json.dumps(chunk, separators=(",", ":")))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_events_are_the_chunks_as_server_sent_events(chat):
    asm = Assembler(
        SimpleNamespace(tokenizer=None),
        "x",
        "m\u00e9",
        2,
        1,
        chat=chat,
        echo=None if chat else ["p"],
    )
    step = pdserve_pb2.GenerateResponse()
    step.deltas.add(index=0, text='caf\u00e9 "q"\n', token_ids=[5])
    lp = step.deltas.add(index=1, text="x", token_ids=[6]).logprobs.add(token_id=6, logprob=-0.5)
    lp.top.add(token_id=6, logprob=-0.5, text="x")
    last = pdserve_pb2.GenerateResponse()
    last.deltas.add(index=0, text="!", token_ids=[7])
    last.final.completions.add(index=0, finish_reason=pdserve_pb2.FINISH_REASON_STOP)
    last.final.completions.add(index=1, finish_reason=pdserve_pb2.FINISH_REASON_LENGTH)
    twin = Assembler(SimpleNamespace(tokenizer=None), "x", "m\u00e9", 2, 1, chat=chat)
    twin.id, twin.created, twin.echo = asm.id, asm.created, asm.echo
    assert asm.start_events() == b"".join(_old_event(c) for c in twin.start_chunks())
    for response in (step, last, pdserve_pb2.GenerateResponse()):
        expected = b"".join(_old_event(c) for c in twin.chunks(0, response))
        assert asm.events(0, response) == expected
    assert asm.usage() == twin.usage()
