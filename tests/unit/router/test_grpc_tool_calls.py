"""gRPC tool calls (router/tool_calls.py): ChatMessages.tool_choice plans the
grammar; each completion's text, parsed at the Final, gives Completion.tool_calls."""

from __future__ import annotations

import json

import pytest

from proto import pdserve_pb2
from router.tool_calls import ToolCallOutput, ToolCallsFailed

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def request(choice: pdserve_pb2.ToolChoice | None) -> pdserve_pb2.GenerateRequest:
    r = pdserve_pb2.GenerateRequest()
    r.chat.messages.add(role="user", content="Weather?")
    r.chat.tools.add(name="get_weather", parameters=json.dumps(PARAMS))
    if choice is not None:
        r.chat.tool_choice.CopyFrom(choice)
    return r


def messages(*texts: str) -> list[pdserve_pb2.GenerateResponse]:
    out = []
    for text in texts:
        m = pdserve_pb2.GenerateResponse()
        m.deltas.add(index=0, text=text)
        out.append(m)
    out[-1].final.completions.add(index=0, finish_reason=pdserve_pb2.FINISH_REASON_STOP)
    return out


def test_unset_or_none_parses_nothing_and_forces_nothing():
    for choice in (None, pdserve_pb2.ToolChoice(mode=pdserve_pb2.TOOL_CHOICE_MODE_NONE)):
        r = request(choice)
        assert ToolCallOutput.of(r, "hermes") is None
        assert not r.sampling.HasField("structured_outputs")


def test_a_named_function_is_forced_by_its_schema_and_comes_back_on_the_final():
    r = request(pdserve_pb2.ToolChoice(function_name="get_weather"))
    calls = ToolCallOutput.of(r, None)
    assert json.loads(r.sampling.structured_outputs.json_schema) == PARAMS
    stream = messages('{"city": ', '"Oslo"}')
    for m in stream:
        calls.observe(m)
    (call,) = stream[-1].final.completions[0].tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    assert call.id.startswith("call_")
    assert [d.text for m in stream for d in m.deltas] == ['{"city": ', '"Oslo"}']  # raw text kept


def test_auto_uses_the_routers_parser_and_required_an_array_grammar():
    auto = request(pdserve_pb2.ToolChoice(mode=pdserve_pb2.TOOL_CHOICE_MODE_AUTO))
    calls = ToolCallOutput.of(auto, "hermes")
    assert not auto.sampling.HasField("structured_outputs")
    stream = messages('Sure. <tool_call>{"name": "get_weather", ', '"arguments": {"city": "Rome"}}</tool_call>')  # fmt: skip
    for m in stream:
        calls.observe(m)
    assert [c.name for c in stream[-1].final.completions[0].tool_calls] == ["get_weather"]
    required = request(pdserve_pb2.ToolChoice(mode=pdserve_pb2.TOOL_CHOICE_MODE_REQUIRED))
    required.chat.parallel_tool_calls = False
    ToolCallOutput.of(required, None)
    schema = json.loads(required.sampling.structured_outputs.json_schema)
    assert schema["type"] == "array" and schema["maxItems"] == 1


@pytest.mark.parametrize(
    ("choice", "parser", "words"),
    [
        (pdserve_pb2.ToolChoice(function_name="nope"), None, "chat.tool_choice.function_name"),
        (pdserve_pb2.ToolChoice(mode=pdserve_pb2.TOOL_CHOICE_MODE_AUTO), None, "--tool-call-parser"),
        (pdserve_pb2.ToolChoice(), None, "sets no mode"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_named(choice, parser, words):
    r = request(choice)
    if not choice.WhichOneof("choice"):
        r.chat.tool_choice.SetInParent()
    with pytest.raises(ToolCallsFailed) as info:
        ToolCallOutput.of(r, parser)
    assert words in str(info.value)


def test_a_forced_call_and_structured_outputs_together_are_refused():
    r = request(pdserve_pb2.ToolChoice(function_name="get_weather"))
    r.sampling.structured_outputs.regex = "a"
    with pytest.raises(ToolCallsFailed, match="set one"):
        ToolCallOutput.of(r, None)
