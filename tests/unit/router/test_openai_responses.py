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
    chat_request = request.to_chat()
    _, plan = chat_request.to_generate("hermes", reasoning=True)
    chat = Assembler(
        SimpleNamespace(tokenizer=None), "chatcmpl", "m", 1, 1, chat=True, output=plan,
        top_logprobs=chat_request.top_logprobs or 0,
    )  # fmt: skip
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
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.reasoning_summary_part.added",
                         "response.content_part.added"]  # fmt: skip
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


def _logprob_messages(pieces: list[str], top: int) -> list[pdserve_pb2.GenerateResponse]:
    """``_messages`` whose tokens carry logprobs: token i is -i/10, ``top`` candidates."""
    out = _messages(pieces, pdserve_pb2.FINISH_REASON_STOP)
    for i, message in enumerate(out):
        lp = message.deltas[0].logprobs.add(token_id=i, logprob=-i / 10, rank=1)
        lp.top.add(token_id=i, logprob=-i / 10, text=pieces[i])
        for j in range(1, top):
            lp.top.add(token_id=1000 + j, logprob=-i / 10 - j, text=f"alt{j}")
    return out


SUMMARY_EVENTS = [
    "response.reasoning_summary_part.added",
    "response.reasoning_summary_text.delta",
    "response.reasoning_summary_text.done",
    "response.reasoning_summary_part.done",
]


@pytest.mark.parametrize("summary", [True, False])
def test_a_reasoning_summary_streams_its_own_events_adding_up_to_the_item(summary):
    body = {"stream": True} | ({"reasoning": {"summary": "auto"}} if summary else {})
    asm = _assembler(body)
    data = asm.start_events()
    for message in _messages(["<think>hm", "m, yes", "</think>No"], pdserve_pb2.FINISH_REASON_STOP):  # fmt: skip
        data += asm.events(0, message)
    events = _parse_sse(data + asm.end_events(False))
    for e in events:
        EVENTS.validate_python(e)
    kinds = [e["type"] for e in events]
    if not summary:
        assert not set(SUMMARY_EVENTS) & set(kinds)
        assert events[-1]["response"]["output"][0]["summary"] == []
        return
    # Each summary event's first place is in OpenAI's order, the item's added and done around them.
    firsts = [kinds.index(k) for k in SUMMARY_EVENTS]
    assert kinds.index("response.output_item.added") < firsts[0] and firsts == sorted(firsts)
    assert firsts[-1] < kinds.index("response.output_item.done")
    thought = events[-1]["response"]["output"][0]
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta"]
    (done,) = [e for e in events if e["type"] == "response.reasoning_summary_text.done"]
    (part,) = [e for e in events if e["type"] == "response.reasoning_summary_part.done"]
    assert "".join(deltas) == done["text"] == part["part"]["text"] == "hmm, yes"
    assert thought["summary"] == [{"type": "summary_text", "text": "hmm, yes"}]
    assert all(e["summary_index"] == 0 and e["item_id"] == thought["id"]
               for e in events if e["type"] in SUMMARY_EVENTS)  # fmt: skip


def test_output_text_logprobs_are_the_messages_tokens_streamed_and_whole():
    """include asks for them: the reasoning's and the call's tokens are not the
    message's; a token held back (half a tag) goes with the text that follows."""
    pieces = ["<think>a", "b</think>", "Su", "re <", "x", '<tool_call>{"name": "get_weather", ',
              '"arguments": {}}</tool_call>']  # fmt: skip
    body = {"tools": [WEATHER], "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    streamed, whole = _assembler(body | {"stream": True}), _assembler(body)
    data = streamed.start_events()
    for message in _logprob_messages(pieces, top=3):
        data += streamed.events(0, message)
    events = _parse_sse(data + streamed.end_events(False))
    for message in _logprob_messages(pieces, top=3):
        whole.add(0, message)
    raw = whole.whole()
    for output in (Response.model_validate(raw).output, events[-1]["response"]["output"]):
        message = output[1] if isinstance(output[1], dict) else output[1].model_dump()
        (text,) = message["content"]
        assert text["text"] == "Sure <x"
        # Tokens 2 ("Su"), 3 ("re <", held: "<" may open a tag), 4 ("x") wrote the text.
        assert [e["logprob"] for e in text["logprobs"]] == [-0.2, -0.3, -0.4]
        assert [e["token"] for e in text["logprobs"]] == ["Su", "re <", "x"]
        assert all(len(e["top_logprobs"]) == 2 for e in text["logprobs"])
        assert text["logprobs"][0]["top_logprobs"][1] == {"token": "alt1", "logprob": -1.2, "bytes": list(b"alt1")}  # fmt: skip
    for e in events:
        EVENTS.validate_python(e)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp["token"] for e in deltas for lp in e["logprobs"]] == ["Su", "re <", "x"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp["logprob"] for lp in done["logprobs"]] == [-0.2, -0.3, -0.4]
    assert events[-1]["response"]["top_logprobs"] == 2


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"include": ["reasoning.encrypted_content"]}, "include.0", "only"),
        ({"top_logprobs": 3}, "top_logprobs", "needs include"),
        (
            {"include": ["message.output_text.logprobs"], "top_logprobs": 21},
            "top_logprobs",
            "[0, 20]",
        ),
    ],
)
def test_logprobs_ask_through_include_and_top_logprobs_in_range(body, param, words):
    with pytest.raises(InvalidField) as info:
        ResponsesRequest.model_validate({"input": "x"} | body).to_chat()
    assert info.value.param == param and words in str(info.value)
    chat = ResponsesRequest.model_validate(
        {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 4}
    ).to_chat()
    assert (chat.logprobs, chat.top_logprobs) == (True, 4)
