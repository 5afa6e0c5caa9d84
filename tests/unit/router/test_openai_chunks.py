"""The OpenAI stream's chunks: every step that generated tokens makes a chunk."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from proto import pdserve_pb2
from router.http.chat_output import OutputPlan
from router.http.chunks import Assembler, EchoLogprobs


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


# -- echo with logprobs, and vLLM's prompt_logprobs (issue 50, item 3) ------------------------


def first_message(prompt: list[tuple[int, str, float]], token: tuple[int, str, float]):
    """A prompt's first message: its prompt logprobs (from the second token)
    and one generated token, with one candidate each."""
    out = pdserve_pb2.GenerateResponse()
    for token_id, text, lp in prompt:
        entry = out.prompt_logprobs.add(token_id=token_id, logprob=lp, rank=1)
        entry.top.add(token_id=token_id, logprob=lp, text=text)
    token_id, text, lp = token
    delta = out.deltas.add(index=0, text=text, token_ids=[token_id])
    delta.logprobs.add(token_id=token_id, logprob=lp, rank=1).top.add(
        token_id=token_id, logprob=lp, text=text
    )
    out.final.completions.add(index=0, finish_reason=pdserve_pb2.FINISH_REASON_LENGTH)
    out.final.usage.prompt_tokens, out.final.usage.completion_tokens = 3, 1
    return out


TOKENIZER = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: {1: "The"}[ids[0]]))
PROMPT = [(2, " cat", -2.5), (3, " sat", -1.25)]


@pytest.mark.parametrize("only", [False, True], ids=["max_tokens 1", "max_tokens 0"])
def test_echo_with_logprobs_is_openais_legacy_shape(only):
    asm = Assembler(
        TOKENIZER, "cmpl", "m", 1, 1, chat=False, echo=["The cat sat"],
        echo_logprobs=EchoLogprobs([1]), echo_only=only,
    )  # fmt: skip
    asm.add(0, first_message(PROMPT, (4, " on", -0.5)))
    (choice,) = asm.whole()["choices"]
    tokens = ["The", " cat", " sat"] + ([] if only else [" on"])
    assert choice["text"] == "".join(tokens)
    assert choice["logprobs"] == {
        "tokens": tokens,
        "token_logprobs": [None, -2.5, -1.25] + ([] if only else [-0.5]),
        "top_logprobs": [None, {" cat": -2.5}, {" sat": -1.25}] + ([] if only else [{" on": -0.5}]),
        "text_offset": [0, 3, 7] + ([] if only else [11]),
    }
    assert asm.usage()["completion_tokens"] == (0 if only else 1)


def test_echo_with_logprobs_streams_the_prompt_first():
    asm = Assembler(
        TOKENIZER, "cmpl", "m", 1, 1, chat=False, echo=["The cat sat"],
        echo_logprobs=EchoLogprobs([1]),
    )  # fmt: skip
    assert asm.start_chunks() == []  # the echo waits for its logprobs
    echo, token, end = (
        c["choices"][0] for c in asm.chunks(0, first_message(PROMPT, (4, " on", -0.5)))
    )
    assert echo["text"] == "The cat sat" and echo["logprobs"]["token_logprobs"] == [
        None,
        -2.5,
        -1.25,
    ]
    assert token["text"] == " on" and token["logprobs"]["text_offset"] == [11]
    assert end["finish_reason"] == "length"


def test_vllms_prompt_logprobs_extra():
    asm = Assembler(TOKENIZER, "cmpl", "m", 1, 1, chat=False, prompt_logprobs=True)
    asm.add(0, first_message(PROMPT, (4, " on", -0.5)))
    (choice,) = asm.whole()["choices"]
    assert choice["prompt_logprobs"] == [
        None,
        {"2": {"logprob": -2.5, "rank": 1, "decoded_token": " cat"}},
        {"3": {"logprob": -1.25, "rank": 1, "decoded_token": " sat"}},
    ]
    assert choice["text"] == " on"


def test_a_stream_ends_with_the_usage_chunk_when_asked_then_done():
    asm = Assembler(SimpleNamespace(tokenizer=None), "x", "m", 1, 1, chat=True)
    done = b"data: [DONE]\n\n"
    assert asm.end_events(False) == done
    assert asm.end_events(True) == _old_event(asm.usage_chunk()) + done
    error = {"error": {"message": "gone", "type": "t", "param": None, "code": None}}
    assert asm.error_events(error) == _old_event(error) + done


# -- vLLM's return_token_ids ------------------------------------------------------------------


def _steps() -> tuple[pdserve_pb2.GenerateResponse, pdserve_pb2.GenerateResponse]:
    step = pdserve_pb2.GenerateResponse()
    step.deltas.add(index=0, text="<thi", token_ids=[5, 6])  # text a parser may hold back
    step.deltas.add(index=1, text="b", token_ids=[7])
    last = pdserve_pb2.GenerateResponse()
    last.deltas.add(index=0, text="c", token_ids=[8])
    for i in (0, 1):
        last.final.completions.add(index=i, finish_reason=pdserve_pb2.FINISH_REASON_STOP)
    return step, last


def test_completions_stream_each_chunks_ids_and_the_prompts_ids_first():
    asm = Assembler(
        SimpleNamespace(tokenizer=None), "cmpl", "m", 2, 1, chat=False, prompt_ids=[[1, 2, 3]]
    )
    assert asm.start_chunks() == []  # no echo: nothing before the first token
    chunks = [c["choices"][0] for r in _steps() for c in asm.chunks(0, r)]
    firsts = [c for c in chunks if "prompt_token_ids" in c]
    assert [c["index"] for c in firsts] == [0, 1]  # once per choice, on its first chunk
    assert all(c["prompt_token_ids"] == [1, 2, 3] for c in firsts)
    for index, want in ((0, [5, 6, 8]), (1, [7])):
        mine = [c for c in chunks if c["index"] == index]
        assert [t for c in mine for t in c["token_ids"]] == want  # every chunk has the key
    # The events are the chunks' bytes (the per-token fast path is not taken).
    twin = Assembler(
        SimpleNamespace(tokenizer=None), "cmpl", "m", 2, 1, chat=False, prompt_ids=[[1, 2, 3]]
    )
    twin.id, twin.created = asm.id, asm.created
    events = b"".join(twin.events(0, r) for r in _steps())
    assert events == b"".join(_old_event(asm._chunk(c)) for c in chunks)


def test_chat_ids_beside_the_role_chunk_and_on_each_choice():
    asm = Assembler(
        SimpleNamespace(tokenizer=None), "chatcmpl", "m", 2, 1, chat=True, prompt_ids=[[9, 9]]
    )
    start = asm.start_chunks()
    assert [c["prompt_token_ids"] for c in start] == [[9, 9], [9, 9]]
    assert all("token_ids" not in c["choices"][0] for c in start)
    assert asm.start_events() == b"".join(_old_event(c) for c in start)
    chunks = [c for r in _steps() for c in asm.chunks(0, r)]
    assert all("prompt_token_ids" not in c for c in chunks)
    first = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == 0]
    assert [t for c in first for t in c["token_ids"]] == [5, 6, 8]
    whole = Assembler(
        SimpleNamespace(tokenizer=None), "chatcmpl", "m", 2, 1, chat=True, prompt_ids=[[9, 9]]
    )
    for r in _steps():
        whole.add(0, r)
    out = whole.whole()
    assert out["prompt_token_ids"] == [9, 9]
    assert [c["token_ids"] for c in out["choices"]] == [[5, 6, 8], [7]]
    assert "prompt_token_ids" not in out["choices"][0]


def test_held_back_text_still_sends_its_token_ids():
    # A reasoning parser holds "<thi" back (it may open <think>): vLLM still
    # sends the step's ids, in a chunk with an empty delta.
    asm = Assembler(
        SimpleNamespace(tokenizer=None), "chatcmpl", "m", 2, 1, chat=True,
        output=OutputPlan(reasoning=True), prompt_ids=[[9]],
    )  # fmt: skip
    step, _ = _steps()
    (held, other) = [c["choices"][0] for c in asm.chunks(0, step)]
    assert held == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [5, 6]
    }  # fmt: skip
    assert other["token_ids"] == [7]


def test_without_return_token_ids_no_such_fields():
    for chat in (False, True):
        asm = Assembler(SimpleNamespace(tokenizer=None), "x", "m", 2, 1, chat=chat)
        chunks = [*asm.start_chunks(), *(c for r in _steps() for c in asm.chunks(0, r))]
        for r in _steps():
            asm.add(0, r)
        for obj in [*chunks, asm.whole()]:
            text = json.dumps(obj)
            assert "token_ids" not in text, text
