"""POST /v1/responses as a translation layer: the body -> a chat request, the
chat output -> the Responses object and events, checked against the openai
package's own types (validated strictly with pydantic) and its stream state."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pydantic
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from proto import pdserve_pb2
from router.http.chunks import Assembler
from router.http.response_output import ResponsesAssembler
from router.http.responses import ResponsesRequest, responses_param
from router.http.structured import InvalidField

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def test_input_items_become_the_chat_conversation():
    body = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                             {"type": "input_text", "text": "in Oslo?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city": "Oslo"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": '{"t": 3}'},
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                "strict": True}},
            "max_output_tokens": 7,
            "store": True,  # accepted: nothing is stored all the same
            "seed": 3,  # a vLLM extra reaches the chat request
        }
    )  # fmt: skip
    chat = body.to_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[1].content == "Weather in Oslo?"
    (call,) = chat.messages[2].tool_calls
    assert call == {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    assert (chat.messages[3].tool_call_id, chat.messages[3].name) == ("call_1", "get_weather")
    assert chat.tools[0]["function"]["name"] == "get_weather"
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format["json_schema"]["schema"] == {"type": "object"}
    assert (chat.max_completion_tokens, chat.seed) == (7, 3)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0", "text only"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type", "not supported"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "not supported"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice", "hosted"),
    ],
)  # fmt: skip
def test_what_a_stateless_text_server_cannot_do_is_refused_by_name(body, param, words):
    with pytest.raises(InvalidField) as info:
        ResponsesRequest.model_validate({"input": "x"} | body).to_chat()
    assert info.value.param == param and words in str(info.value)


def test_chat_field_names_in_errors_become_the_responses_names():
    assert responses_param("tools.2.function.parameters") == "tools.2.parameters"
    assert responses_param("tool_choice.function.name") == "tool_choice.name"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("response_format") == "text.format"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("temperature") == "temperature"


def _assembler(body: dict) -> ResponsesAssembler:
    request = ResponsesRequest.model_validate({"input": "x"} | body)
    _, plan = request.to_chat().to_generate("hermes", reasoning=True)
    chat = Assembler(SimpleNamespace(tokenizer=None), "chatcmpl", "m", 1, 1, chat=True, output=plan)
    return ResponsesAssembler(chat, request, request.echo())


def _messages(pieces: list[str], reason) -> list[pdserve_pb2.GenerateResponse]:
    out = []
    for i, text in enumerate(pieces):
        message = pdserve_pb2.GenerateResponse()
        message.deltas.add(index=0, text=text, token_ids=[i])
        out.append(message)
    final = out[-1].final
    final.completions.add(index=0, finish_reason=reason)
    final.usage.prompt_tokens, final.usage.completion_tokens = 11, len(pieces)
    return out


def _parse_sse(data: bytes) -> list[dict]:
    events = []
    for block in data.decode().split("\n\n"):
        if block:
            lines = dict(line.split(": ", 1) for line in block.split("\n"))
            event = json.loads(lines["data"])
            assert lines["event"] == event["type"]
            events.append(event)
    return events


PIECES = ["<think>hm", "m</think>Sure", ". <tool_", 'call>{"name": "get_weather", ',
          '"arguments": {"city": "Rome"}}</tool_call>']  # fmt: skip


STATUS = {
    pdserve_pb2.FINISH_REASON_STOP: "completed",
    pdserve_pb2.FINISH_REASON_LENGTH: "incomplete",  # max_output_tokens
    pdserve_pb2.FINISH_REASON_ABORT: "failed",  # the engine aborted it
}


@pytest.mark.parametrize("reason", list(STATUS))
def test_streamed_events_parse_in_order_and_add_up_to_the_whole_response(reason):
    streamed = _assembler({"tools": [WEATHER], "stream": True, "reasoning": {"summary": "auto"}})
    data = streamed.start_events()
    for message in _messages(PIECES, reason):
        data += streamed.events(0, message)
    data += streamed.end_events(False)
    events = _parse_sse(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    # reasoning, then the message, then the call: each closed before the next opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.delta")  # fmt: skip
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    for e in events:
        state.handle_event(EVENTS.validate_python(e))  # strict: every required field
    final = events[-1]["response"]
    status = STATUS[reason]
    assert events[-1]["type"] == f"response.{status}" and final["status"] == status
    whole = _assembler({"tools": [WEATHER], "reasoning": {"summary": "auto"}})
    for message in _messages(PIECES, reason):
        whole.add(0, message)
    raw = whole.whole()
    body = Response.model_validate(raw)
    assert [i.type for i in body.output] == ["reasoning", "message", "function_call"]
    assert body.output[0].summary[0].text == "hmm" == body.output[0].content[0].text
    assert body.output_text == "Sure. "
    call = body.output[2]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})
    assert call.call_id.startswith("call_") and body.usage.input_tokens == 11
    assert _without_ids(final["output"]) == _without_ids(raw["output"])
    assert (body.incomplete_details is not None) == (status == "incomplete")
    assert (body.error is not None) == (status == "failed")


def _without_ids(items: list[dict]) -> list[dict]:
    """Items as compared streamed against whole (each request makes its own ids)."""
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


def test_a_named_call_streams_its_arguments_as_deltas():
    asm = _assembler({"tools": [WEATHER], "stream": True,
                      "tool_choice": {"type": "function", "name": "get_weather"}})  # fmt: skip
    data = asm.start_events()
    for message in _messages(['{"city": ', '"Rome"}'], pdserve_pb2.FINISH_REASON_STOP):
        data += asm.events(0, message)
    events = _parse_sse(data + asm.end_events(False))
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"city": ', '"Rome"}']
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == '{"city": "Rome"}' and done["name"] == "get_weather"
    assert events[-1]["response"]["output"][0]["status"] == "completed"


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    asm = _assembler({})
    asm.start_events()
    error = {"error": {"message": "gone", "type": "service_unavailable", "param": None, "code": None}}  # fmt: skip
    events = _parse_sse(asm.error_events(error))
    assert [e["type"] for e in events] == ["error", "response.failed"]
    for e in events:
        EVENTS.validate_python(e)
    assert events[1]["response"]["error"]["message"] == "gone"
