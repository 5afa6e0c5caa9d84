"""Tool-call and reasoning parsers, streamed in pieces and whole (router/http/)."""

from __future__ import annotations

import json

import pytest

from router.http.chat_output import OutputPlan
from router.http.reasoning import ReasoningSplitter
from router.http.structured import InvalidField
from router.http.tool_parsers import HermesParser, Llama3JsonParser, RequiredCalls
from router.http.tools import ToolChoice, plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/City"}},
            "required": ["city"],
            "$defs": {"City": {"type": "string"}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def run(parser, pieces: list[str]) -> list[tuple]:
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    out: list[tuple] = []
    for e in events:  # adjacent content pieces joined: how they are cut is free
        if e[0] == "content" and out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + e[1])
        elif e != ("content", ""):
            out.append(e)
    return out


def every_split(text: str) -> list[list[str]]:
    """The text whole, char by char, and cut in two at every place."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


HERMES = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("pieces", every_split(HERMES))
def test_hermes_finds_the_call_however_the_text_is_cut(pieces):
    assert run(HermesParser(), pieces) == [
        ("content", "Sure. "),
        ("call", "get_weather", '{"city": "Paris"}'),
    ]


def test_hermes_keeps_bad_blocks_as_text_and_parallel_false_keeps_the_first():
    bad = "<tool_call>{not json}</tool_call>"
    assert run(HermesParser(), [bad]) == [("content", bad)]
    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    )
    assert [e[1] for e in run(HermesParser(), [two])] == ["a", "b"]
    assert [e[1] for e in run(HermesParser(parallel=False), [two])] == ["a"]
    # Cut short inside a block: a call if what came parses, else text.
    assert run(HermesParser(), ['<tool_call>{"name": "a", "arguments": {}}']) == [
        ("call", "a", "{}")
    ]
    assert run(HermesParser(), ['hi <tool_call>{"name": "a"']) == [
        ("content", 'hi <tool_call>{"name": "a"')
    ]
    assert run(HermesParser(), ["a < b <tool"]) == [("content", "a < b <tool")]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"name": "f", "parameters": {"x": 1}}', [("call", "f", '{"x": 1}')]),
        ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": 2}}',
         [("call", "f", "{}"), ("call", "g", '{"y": 2}')]),
        ("The answer is 4.", [("content", "The answer is 4.")]),
        ('{"not": "a call"}', [("content", '{"not": "a call"}')]),
    ],
)  # fmt: skip
def test_llama3_json(text, want):
    for pieces in ([text], list(text)):
        assert run(Llama3JsonParser(), pieces) == want


def test_required_calls_parse_the_grammars_array_or_give_the_text():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert run(RequiredCalls(), list(text)) == [("call", "a", '{"x": 1}'), ("call", "b", "{}")]
    assert run(RequiredCalls(), ['[{"name": "a", "param']) == [("content", '[{"name": "a", "param')]


@pytest.mark.parametrize("pieces", every_split("<think>hmm, 2+2</think>\n\nIt is 4."))
def test_reasoning_splits_however_the_text_is_cut(pieces):
    splitter = ReasoningSplitter()
    out = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    reasoning = "".join(t for k, t in out if k == "reasoning")
    content = "".join(t for k, t in out if k == "content")
    assert (reasoning, content) == ("hmm, 2+2", "\n\nIt is 4.")


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [("no thinking here", "", "no thinking here"), ("<think>cut short", "cut short", ""),
     ("<thin", "", "<thin"), ("  <think>a</think>b", "a", "b")],
)  # fmt: skip
def test_reasoning_edges(text, reasoning, content):
    plan = OutputPlan(reasoning=True)
    choice = plan.new_choice()
    for c in text:
        choice.feed(c)
    choice.finish()
    msg = choice.message()
    assert (msg["reasoning_content"] or "", msg["content"]) == (reasoning, content)


def test_required_and_named_plans_make_grammars_that_name_the_tools():
    plan = plan_tools([WEATHER, TIME], "required", False, None)
    schema = plan.required_schema()
    assert schema["maxItems"] == 1 and schema["$defs"] == {"City": {"type": "string"}}
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    named = plan_tools(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None
    )
    assert named.choice is ToolChoice.NAMED
    spec = named.constraint().spec
    assert json.loads(spec.json_schema)["required"] == ["city"] and spec.disable_any_whitespace


def test_whole_message_and_finish_reason_of_a_streamed_named_call():
    plan = OutputPlan(tools=plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None))  # fmt: skip
    choice = plan.new_choice()
    deltas = choice.feed('{"city":') + choice.feed('"Oslo"}') + choice.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas)
    assert args == '{"city":"Oslo"}'
    msg = choice.message()
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["arguments"] == args
    assert (
        choice.finish_reason("stop") == "tool_calls" and choice.finish_reason("length") == "length"
    )


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "param"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
        ([WEATHER], "auto", None, "tool_choice"),
        ([WEATHER], "sometimes", "hermes", "tool_choice"),
        (None, "required", "hermes", "tool_choice"),
        ([{"type": "function", "function": {"name": "bad name"}}], "required", None, "tools.0.function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
         "none", None, "tools.0.function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
         "none", None, "tools.0.function.parameters"),
        ([WEATHER, WEATHER], "required", None, "tools.1.function.name"),
        ([{"type": "retrieval"}], "required", None, "tools.0.type"),
    ],
)  # fmt: skip
def test_bad_tools_are_named(tools, choice, parser, param):
    with pytest.raises(InvalidField) as e:
        plan_tools(tools, choice, None, parser)
    assert e.value.param == param
