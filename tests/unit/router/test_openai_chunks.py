"""The OpenAI stream's chunks: every step that generated tokens makes a chunk."""

from __future__ import annotations

from types import SimpleNamespace

from proto import pdserve_pb2
from router.openai_chunks import Assembler


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
