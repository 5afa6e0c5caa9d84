"""The reasoning split on the gRPC API (router/reasoning_output.py): a chat
request's deltas, with the router's --reasoning-parser, carry the thinking in
reasoning_text and the answer in text, as the HTTP API splits them; the tool
calls are then parsed from the answer alone."""

from __future__ import annotations

import json

from proto import pdserve_pb2
from router.reasoning_output import ReasoningOutput
from router.tool_calls import ToolCallOutput


def chat_request() -> pdserve_pb2.GenerateRequest:
    r = pdserve_pb2.GenerateRequest()
    r.chat.messages.add(role="user", content="Weather?")
    return r


def stream(pieces: list[tuple[int, str]]) -> list[pdserve_pb2.GenerateResponse]:
    """One message per (completion index, text), token ids numbered; the last with the Final."""
    out = []
    for i, (index, text) in enumerate(pieces):
        m = pdserve_pb2.GenerateResponse()
        m.deltas.add(index=index, text=text, token_ids=[i])
        out.append(m)
    for index in sorted({index for index, _ in pieces}):
        out[-1].final.completions.add(index=index, finish_reason=pdserve_pb2.FINISH_REASON_STOP)
    return out


def split(pieces, request=None) -> tuple[dict, list[pdserve_pb2.GenerateResponse]]:
    """(by completion index: (reasoning, text)), the messages as sent."""
    output = ReasoningOutput.of(request or chat_request(), "qwen3")
    messages = stream(pieces)
    by: dict[int, list[str]] = {}
    for m in messages:
        output.observe(m)
        for d in m.deltas:
            got = by.setdefault(d.index, ["", ""])
            got[0] += d.reasoning_text
            got[1] += d.text
    return {i: tuple(v) for i, v in by.items()}, messages


def test_each_completion_is_split_and_the_tags_are_in_neither_field():
    got, messages = split([(0, "<thi"), (1, "Plain"), (0, "nk>a"), (0, "b</th"), (1, " answer"),
                           (0, "ink>Yes")])  # fmt: skip
    assert got == {0: ("ab", "Yes"), 1: ("", "Plain answer")}
    # Each delta keeps its token ids; half a tag waits for the next delta.
    assert [list(d.token_ids) for m in messages for d in m.deltas] == [[0], [1], [2], [3], [4], [5]]
    assert messages[0].deltas[0].text == messages[0].deltas[0].reasoning_text == ""
    assert (messages[3].deltas[0].reasoning_text, messages[3].deltas[0].text) == ("b", "")


def test_what_is_held_at_the_end_comes_with_the_final():
    # A thought cut short stays reasoning; its held "</" comes on the Final's message.
    got, messages = split([(0, "<think>hmm </"), (1, "<thi")])
    assert got == {0: ("hmm </", ""), 1: ("", "<thi")}
    final = messages[-1]
    assert {d.index for d in final.deltas} == {0, 1}  # completion 0's delta added, no tokens
    (added,) = [d for d in final.deltas if d.index == 0]
    assert (added.reasoning_text, list(added.token_ids)) == ("</", [])


def test_not_split_without_a_parser_or_for_a_raw_prompt():
    assert ReasoningOutput.of(chat_request(), None) is None
    assert ReasoningOutput.of(pdserve_pb2.GenerateRequest(prompt="<think>x"), "qwen3") is None


def test_tool_calls_are_parsed_from_the_answer_not_the_thought():
    request = chat_request()
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    request.chat.tools.add(name="get_weather", parameters=json.dumps(params))
    request.chat.tool_choice.mode = pdserve_pb2.TOOL_CHOICE_MODE_AUTO
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    reasoning = ReasoningOutput.of(request, "qwen3")
    calls = ToolCallOutput.of(request, "hermes")
    messages = stream([(0, "<think>" + call % "Oslo"), (0, "</think>"), (0, call % "Rome")])
    for m in messages:
        reasoning.observe(m)
        calls.observe(m)
    (found,) = messages[-1].final.completions[0].tool_calls
    assert json.loads(found.arguments) == {"city": "Rome"}
    assert messages[0].deltas[0].reasoning_text == call % "Oslo"
