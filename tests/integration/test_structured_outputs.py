"""Structured outputs, tool calls, reasoning and the Responses API through one
live `pdserve up` (1 prefill, 1 decode node, --tool-call-parser hermes,
--reasoning-parser qwen3) (issue 51): short prompts prefill on the decode node, long ones (past the
router's local-prefill threshold, 64 tokens here) on the prefill node, whose first token is
sampled under the grammar and replayed into the decode node's matcher.

Requests go in batches (one thread each) so that the engine serves them
together; every output that ends with "stop" must validate, and every one
must end with "stop" (the schemas are bounded so that it can).

The cluster also serves one LoRA adapter (``--lora-modules sql=...``, issue
56): base-model requests never use it (a batch without adapter rows runs the
base layers alone), and test_lora_adapter checks it through both encodings,
locally and disaggregated; test_lora_adapter_loaded_and_unloaded_at_run_time
loads a second name over vLLM's HTTP endpoints, runs a request under it and
unloads it."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.runtime.ports import free_port_block
from pdserve.redis_server import free_port
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.client import build_request
from tests.integration.structured_schemas import SCHEMAS
from tests.pdserve_up import UpProcess

pytestmark = pytest.mark.timeout(900)

# Past this cluster's local-prefill threshold (LOCAL_PREFILL_MAX_TOKENS uncached
# tokens): a prefill node's work. A short prompt's chat (about 40 tokens) stays below.
LOCAL_PREFILL_MAX_TOKENS = 64
LONG_SYSTEM = "You answer with data only, in the format the user asks for. " * 6
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
        },
    },
}
MODEL = "smollm2-135m-instruct"  # the demo model directory's name
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def sql_adapter(demo_model_dir, tmp_path_factory) -> str:
    """A random PEFT adapter of the demo model (r=4 on q_proj/v_proj, B not zero)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    out = tmp_path_factory.mktemp("sql-adapter")
    peft.get_peft_model(base, config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def up(demo_model_dir, sql_adapter, tmp_path_factory):
    logs = tmp_path_factory.mktemp("structured-logs")
    http_port = free_port()
    cluster = UpProcess(
        ["--model", str(demo_model_dir), "--prefill", "1", "--decode", "1"]
        + ["--port", str(free_port()), "--admin-port", str(free_port())]
        + ["--http-port", str(http_port), "--metrics-port", str(free_port_block(4))]
        + ["--max-model-len", "2048"]
        + ["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--log-dir", str(logs)]
        + ["--lora-modules", f"sql={sql_adapter}", "--allow-runtime-lora-updating"],
        # A KV cache of its own size, not one sized from the host's free memory
        # (which other work on a test host makes small and the batches preempt);
        # a low local-prefill threshold, so that a disaggregated prompt is short
        # (each has a salt of its own: every one is prefilled in full on a CPU).
        env={
            "PDSERVE_NUM_KVCACHE_BLOCKS": "1024",
            "PDSERVE_LOCAL_PREFILL_MAX_TOKENS": str(LOCAL_PREFILL_MAX_TOKENS),
        },
    )
    cluster.wait_ready()
    cluster.http_port = http_port
    yield cluster
    cluster.stop(timeout=60)


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="x", max_retries=0, timeout=600
    )


@pytest.fixture(scope="module")
def stub(up):
    channel = grpc.insecure_channel(up.router)
    yield pdserve_pb2_grpc.RouterStub(channel)
    channel.close()


def messages(text: str, remote: bool) -> list[dict]:
    system = [{"role": "system", "content": LONG_SYSTEM}] if remote else []
    return [*system, {"role": "user", "content": text}]


def in_parallel(fn, items: list) -> list:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def check(schema: dict, text: str) -> None:
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(json.loads(text))


def streamed_chat(client, **kwargs) -> tuple[str, str, list]:
    """(content, finish_reason, chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)  # fmt: skip
    return content, finish, chunks


def spelling(i: int, schema: dict) -> dict:
    """The schema in one of the ways a client asks for it (all of them used)."""
    if i % 3 == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}  # fmt: skip
        return {"response_format": fmt}
    if i % 3 == 1:  # compact: fewer tokens
        return {"extra_body": {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}}  # fmt: skip
    return {"extra_body": {"guided_json": schema}}


def test_every_schema_validates_streamed_or_not_local_or_disaggregated(client):
    """Each schema once, in one batch, its case turning through streamed or
    not, local or disaggregated prefill (a long prompt with a salt of its own,
    so the decode node's cache cannot make it local), and the spellings;
    seeded sampling at temperature 1.0."""

    def one(i):
        stream, remote = bool(i & 1), bool(i & 2)
        kwargs = spelling(i, SCHEMAS[i])
        extra = kwargs.setdefault("extra_body", {})
        if remote:
            extra["cache_salt"] = f"schema-{i}"
        kwargs |= dict(
            model=MODEL,
            messages=messages("Reply with a JSON value.", remote),
            max_tokens=160,
            temperature=1.0,
            seed=i,
        )
        if stream:
            text, finish, _ = streamed_chat(client, **kwargs)
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            text, finish = choice.message.content, choice.finish_reason
        return i, text, finish

    for i, text, finish in in_parallel(one, list(range(len(SCHEMAS)))):
        assert finish == "stop", (i, text)
        check(SCHEMAS[i], text)


def test_disaggregated_grpc_schemas_compact_and_seeded_repeatable(stub):
    """Over gRPC (where the Final names the prefill node), compact JSON; the
    same seed gives the same output on a second run."""
    # Schemas the first test sent to the prefill node: their grammars are in
    # both nodes' caches (a cold compile on a busy CPU can outlast the decode
    # node's KV lease, and the request then retries with local prefill).
    picks = [i for i in range(len(SCHEMAS)) if i & 2][::2]

    def one(i):
        request = build_request(
            chat=messages("Reply with a JSON value.", remote=True),
            cache_salt=f"grpc-{i}",
            max_tokens=120,
            temperature=1.0,
            seed=i,
            structured_outputs=pdserve_pb2.StructuredOutputs(
                json_schema=json.dumps(SCHEMAS[i]), disable_any_whitespace=True
            ),
        )
        responses = list(stub.Generate(request, timeout=600))
        text = "".join(d.text for r in responses for d in r.deltas)
        return i, text, responses[-1].final

    first = in_parallel(one, picks)
    for i, text, final in first:
        assert final.usage.prefill_node, "a long prompt goes to the prefill node"
        assert final.completions[0].finish_reason == pdserve_pb2.FINISH_REASON_STOP, (i, text)
        check(SCHEMAS[i], text)
        assert "\n" not in text and "  " not in text  # no free whitespace
    again = in_parallel(one, picks[:3])
    assert [t for _, t, _ in again] == [t for _, t, _ in first[:3]]


@pytest.mark.parametrize("remote", [False, True])
def test_regex_choice_and_grammar(client, remote):
    specs = [
        ({"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}"}, r"[A-Z][a-z]{2,6} [0-9]{2}"),
        ({"guided_regex": r"(yes|no), because [a-z ]{3,12}\."}, r"(yes|no), because [a-z ]{3,12}\."),
        ({"guided_choice": ["Paris", "London", "Rome"]}, r"Paris|London|Rome"),
        ({"structured_outputs": {"choice": ["positive", "negative"]}}, r"positive|negative"),
        ({"guided_grammar": 'root ::= "ID-" [0-9] [0-9] [0-9]'}, r"ID-[0-9]{3}"),
    ]  # fmt: skip
    import re

    def one(k):
        extra, _ = specs[k]
        return client.chat.completions.create(
            model=MODEL,
            messages=messages("Answer.", remote),
            max_tokens=40,
            temperature=1.0,
            seed=k,
            extra_body=extra | ({"cache_salt": f"re-{k}"} if remote else {}),
        ).choices[0]

    for (_, pattern), choice in zip(specs, in_parallel(one, range(len(specs))), strict=True):
        assert choice.finish_reason == "stop"
        assert re.fullmatch(pattern, choice.message.content), (pattern, choice.message.content)


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    zip_code: str = pydantic.Field(pattern=r"^[0-9]{5}$")


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    role: str = pydantic.Field(json_schema_extra={"enum": ["dev", "ops"]})
    home: Address


@pytest.mark.parametrize("remote", [False, True])
def test_the_openai_clients_parse_with_a_pydantic_model(client, remote):
    completion = client.beta.chat.completions.parse(
        model=MODEL,
        messages=messages("Describe a person.", remote),
        response_format=Person,
        extra_body={"cache_salt": "parse"} if remote else None,
        max_tokens=120,
        temperature=1.0,
        seed=7,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person) and isinstance(parsed.home, Address)
    assert parsed.role in ("dev", "ops") and len(parsed.home.zip_code) == 5


def test_tool_calls_required_and_named_then_the_result_round_trip(client):
    asked = messages("What is the weather in Paris?", remote=False)

    def call(choice, stream=False):
        kwargs = dict(
            model=MODEL, messages=asked, tools=[WEATHER], tool_choice=choice, max_tokens=60, seed=3
        )
        if stream:
            return streamed_chat(client, **kwargs)
        return client.chat.completions.create(**kwargs).choices[0]

    for choice in ("required", NAMED):
        got = call(choice)
        assert got.finish_reason == "tool_calls" and got.message.content is None
        (tc,) = got.message.tool_calls
        assert tc.id.startswith("call_") and tc.function.name == "get_weather"
        check(WEATHER["function"]["parameters"], tc.function.arguments)
    # The call's result goes back as a tool message; the model answers in text.
    follow = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=follow, tools=[WEATHER], tool_choice="none", max_tokens=8
    ).choices[0]
    assert answer.message.content and not answer.message.tool_calls


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_stream_as_delta_tool_calls(client, choice):
    _, finish, chunks = streamed_chat(
        client,
        model=MODEL,
        messages=messages("Weather in Oslo?", remote=True),
        tools=[WEATHER],
        tool_choice=NAMED if choice == "named" else "required",
        extra_body={"cache_salt": f"tools-{choice}"},
        max_tokens=60,
        temperature=0.0,  # the shape of the stream is the point, not a sample
    )
    parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert finish == "tool_calls" and parts[0].id and parts[0].function.name == "get_weather"
    arguments = "".join(p.function.arguments or "" for p in parts)
    check(WEATHER["function"]["parameters"], arguments)


HERMES_REGEX = (
    r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", '
    r'"unit": "(C|F)"\}\}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_by_the_hermes_parser(client, stream):
    """tool_choice auto: the model's own <tool_call> text (forced here by a
    regex: the demo model never writes one) becomes message.tool_calls."""
    kwargs = dict(
        model=MODEL,
        messages=messages("Weather in Rome?", remote=False),
        tools=[WEATHER],
        max_tokens=80,
        extra_body={"guided_regex": HERMES_REGEX},
    )
    if stream:
        content, finish, chunks = streamed_chat(client, **kwargs)
        parts = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
        name, args = parts[0].function.name, "".join(p.function.arguments for p in parts)
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        (tc,) = choice.message.tool_calls
        name, args = tc.function.name, tc.function.arguments
    assert (content, finish, name) == ("Sure. ", "tool_calls", "get_weather")
    check(WEATHER["function"]["parameters"], args)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_is_split_from_the_answer(client, stream):
    kwargs = dict(
        model=MODEL,
        messages=messages("Think, then answer.", remote=True),
        max_tokens=40,
        extra_body={
            "guided_regex": r"<think>[a-z ]{2,12}</think>[A-Z]{2,4}",
            "cache_salt": f"think-{stream}",
        },
    )
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert 2 <= len(reasoning) <= 12 and reasoning.replace(" ", "").isalpha(), reasoning
    assert content.isupper() and 2 <= len(content) <= 4, content


def test_a_grammar_longer_than_max_tokens_ends_with_length(client):
    choice = client.chat.completions.create(
        model=MODEL,
        messages=messages("Count.", remote=False),
        max_tokens=5,
        extra_body={"guided_regex": "[0-9]{30,40}"},
    ).choices[0]
    assert choice.finish_reason == "length" and choice.message.content.isdigit()


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"response_format": BAD_SCHEMA}, "response_format.json_schema.schema", "'type' must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
         "response_format.json_schema.schema", "uniqueItems"),
        ({"extra_body": {"guided_regex": "(?=a)b"}}, "guided_regex", "lookaround"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "not a valid regex"),
        ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar", "guided_grammar"),
        ({"extra_body": {"guided_regex": "a" * 70000}}, "guided_regex", "too large"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice", "empty"),
        ({"extra_body": {"structured_outputs": {"json": {}, "regex": "a"}}}, "structured_outputs",
         "exactly one"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
         "guided_regex", "both constrain"),
        ({"tools": [BAD_TOOL]}, "tools.0.function.parameters", "negation"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "not in tools"),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=messages("x", False), max_tokens=4, **kwargs
        )
    body = info.value.body
    assert body["param"] == param and words in body["message"], body


def test_grpc_refuses_bad_specs_before_any_node_and_keeps_serving(stub):
    for spec, words in [
        (pdserve_pb2.StructuredOutputs(json_schema="{not json"), "structured_outputs.json"),
        (pdserve_pb2.StructuredOutputs(regex="(?<=a)b"), "structured_outputs.regex"),
        (pdserve_pb2.StructuredOutputs(), "sets no kind"),
    ]:
        request = build_request("Hi", max_tokens=4, structured_outputs=spec)
        if not spec.WhichOneof("kind"):
            request.sampling.structured_outputs.SetInParent()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in info.value.details(), info.value.details()
    good = build_request(
        "Hi", max_tokens=8, structured_outputs=pdserve_pb2.StructuredOutputs(regex="[a-c]{3}")
    )
    text = "".join(d.text for r in stub.Generate(good, timeout=120) for d in r.deltas)
    assert len(text) == 3 and set(text) <= set("abc")


# -- the Responses API, gRPC tool calls, third-party clients ---------------------------
#
# Their requests go in one batch (the module fixture ``batch``: a thread per
# job, all submitted at once, so the engine serves them together); each test
# reads its own job's result.

FLAT_WEATHER = {"type": "function", **WEATHER["function"], "strict": True}
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK = r"<think>[a-z ]{2,12}</think>[A-Z]{2,4}"


class Forecast(pydantic.BaseModel):
    unit: Literal["C", "F"]
    high: int = pydantic.Field(ge=-50, le=50)


def responses_items_and_parse(client):
    plain = client.responses.create(
        model=MODEL,
        instructions="Answer in a few words.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
        max_output_tokens=6,
    )
    parsed = client.responses.parse(
        model=MODEL, input="A forecast.", text_format=Forecast, max_output_tokens=30,
        temperature=1.0, extra_body={"seed": 7},
    )  # fmt: skip
    return plain, parsed


def responses_tool_loop(client):
    """A named call, streamed; its output fed back as input items."""
    with client.responses.stream(
        model=MODEL, input=ASKED, tools=[FLAT_WEATHER], max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": 3},
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    (call,) = final.output
    follow = [
        *ASKED,
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
    ]  # fmt: skip
    answer = client.responses.create(
        model=MODEL, input=follow, tools=[FLAT_WEATHER], tool_choice="none", max_output_tokens=4
    )
    return kinds, final, answer


def responses_reasoning(client, stream: bool):
    kwargs = dict(
        model=MODEL, input="Think, then answer.", max_output_tokens=24,
        reasoning={"summary": "auto"}, extra_body={"guided_regex": THINK},
    )  # fmt: skip
    if stream:
        return list(client.responses.create(stream=True, **kwargs))
    return client.responses.create(**kwargs)


def responses_logprobs(client, stream: bool):
    """The message's token logprobs (include), greedy: each token is its own top candidate."""
    kwargs = dict(
        model=MODEL, input="Name a colour.", max_output_tokens=5, temperature=0,
        include=["message.output_text.logprobs"], top_logprobs=2,
    )  # fmt: skip
    if stream:
        return list(client.responses.create(stream=True, **kwargs))
    return client.responses.create(**kwargs)


def grpc_reasoning(stub):
    """A chat request through the real gRPC server; the router runs --reasoning-parser qwen3."""
    structured = pdserve_pb2.StructuredOutputs(regex=THINK)
    request = build_request(chat=ASKED, max_tokens=24, structured_outputs=structured)
    return list(stub.Generate(request, timeout=300))


def grpc_tool_call(stub, choice: pdserve_pb2.ToolChoice):
    request = build_request(chat=ASKED, max_tokens=40, seed=3)
    tool = WEATHER["function"]
    request.chat.tools.add(
        name=tool["name"],
        description=tool["description"],
        parameters=json.dumps(tool["parameters"]),
    )
    request.chat.tool_choice.CopyFrom(choice)
    responses = list(stub.Generate(request, timeout=300))
    text = "".join(d.text for r in responses for d in r.deltas)
    return text, responses[-1].final.completions[0]


def langchain_chat(up, **kwargs):
    from langchain_openai import ChatOpenAI

    base = f"http://127.0.0.1:{up.http_port}/v1"
    return ChatOpenAI(base_url=base, api_key="x", model=MODEL, max_retries=0, **kwargs)


def langchain_tool_round_trip(up):
    from langchain_core.messages import HumanMessage, ToolMessage

    asked = [HumanMessage(ASKED[0]["content"])]
    tools = langchain_chat(up, max_tokens=40, seed=3).bind_tools([WEATHER], tool_choice="get_weather")  # fmt: skip
    reply = tools.invoke(asked)
    # The call and its result (a ToolMessage) go back; the model answers in text.
    result = ToolMessage('{"temperature": 21}', tool_call_id=reply.tool_calls[0]["id"])
    plain = langchain_chat(up, max_tokens=4, seed=3).bind_tools([WEATHER], tool_choice="none")
    return reply, plain.invoke([*asked, reply, result])


def agent_run(up):
    """One function tool, forced on the first turn (the demo model never calls
    one by itself); the SDK runs it and feeds its output back as a
    function_call_output item; the second turn (tool_choice reset) answers."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # nothing is exported anywhere
    calls = []

    @function_tool
    def get_weather(
        city: Annotated[str, pydantic.Field(max_length=10)], unit: Literal["C", "F"]
    ) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return "21 degrees"

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="x", max_retries=0
    )
    agent = Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", max_tokens=24, temperature=0),
    )
    return calls, Runner.run_sync(agent, ASKED[0]["content"], max_turns=3)


@pytest.fixture(scope="module")
def batch(up, client, stub):
    named = pdserve_pb2.ToolChoice(function_name="get_weather")
    required = pdserve_pb2.ToolChoice(mode=pdserve_pb2.TOOL_CHOICE_MODE_REQUIRED)
    jobs = {
        "responses": lambda: responses_items_and_parse(client),
        "responses_tools": lambda: responses_tool_loop(client),
        "reasoning": lambda: responses_reasoning(client, stream=False),
        "reasoning_streamed": lambda: responses_reasoning(client, stream=True),
        "logprobs": lambda: responses_logprobs(client, stream=False),
        "logprobs_streamed": lambda: responses_logprobs(client, stream=True),
        "grpc_reasoning": lambda: grpc_reasoning(stub),
        "grpc_named": lambda: grpc_tool_call(stub, named),
        "grpc_required": lambda: grpc_tool_call(stub, required),
        "langchain_structured": lambda: (
            langchain_chat(up, max_tokens=30, temperature=1.0, seed=7)
            .with_structured_output(Forecast)
            .invoke("A forecast.")
        ),
        "langchain_tools": lambda: langchain_tool_round_trip(up),
        "agent": lambda: agent_run(up),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        yield {name: pool.submit(job) for name, job in jobs.items()}


def test_responses_create_with_items_and_parse_with_a_pydantic_model(batch):
    plain, parsed = batch["responses"].result()
    assert plain.id.startswith("resp_") and plain.object == "response"
    assert plain.output[0].type == "message" and plain.output_text
    assert plain.status in ("completed", "incomplete")
    assert plain.usage.input_tokens > 0 and 0 < plain.usage.output_tokens <= 6
    assert isinstance(parsed.output_parsed, Forecast) and parsed.status == "completed"


def test_responses_stream_a_function_call_then_take_its_output_back(batch):
    kinds, final, answer = batch["responses_tools"].result()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    check(WEATHER["function"]["parameters"], call.arguments)
    assert all(o.type == "message" for o in answer.output)
    assert answer.usage.input_tokens > final.usage.input_tokens  # the call and its output


def test_responses_reasoning_items_streamed_and_not(batch):
    whole, events = batch["reasoning"].result(), batch["reasoning_streamed"].result()
    streamed = events[-1].response
    for response in (whole, streamed):
        thought, message = response.output
        assert thought.type == "reasoning" and message.type == "message"
        text = thought.content[0].text
        assert 2 <= len(text) <= 12 and thought.summary[0].text == text
        assert response.output_text.isupper()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == streamed.output[0].content[0].text
    # reasoning.summary: the summary's own events, parsed by the client as its types.
    summary = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(summary) == streamed.output[0].summary[0].text
    (part,) = [e.part for e in events if e.type == "response.reasoning_summary_part.done"]
    assert part.type == "summary_text" and part.text == streamed.output[0].summary[0].text


def test_responses_output_text_logprobs_streamed_and_not(batch):
    whole, events = batch["logprobs"].result(), batch["logprobs_streamed"].result()
    streamed = events[-1].response
    for response in (whole, streamed):
        (message,) = response.output
        (text,) = message.content
        logprobs = text.logprobs
        assert "".join(lp.token for lp in logprobs) == text.text and len(logprobs) >= 1
        for lp in logprobs:  # greedy: the chosen token is the best of its two candidates
            best, second = lp.top_logprobs
            assert (best.token, best.logprob) == (lp.token, lp.logprob)
            assert 0 >= best.logprob >= second.logprob
        assert response.top_logprobs == 2
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [
        lp.token for lp in streamed.output[0].content[0].logprobs
    ]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.logprob for lp in done.logprobs] == [
        lp.logprob for lp in streamed.output[0].content[0].logprobs
    ]
    # The same greedy tokens, streamed or not.
    assert whole.output_text == streamed.output_text


def test_grpc_chat_deltas_carry_reasoning_apart_from_the_answer(batch):
    responses = batch["grpc_reasoning"].result()
    deltas = [d for r in responses for d in r.deltas]
    reasoning = "".join(d.reasoning_text for d in deltas)
    answer = "".join(d.text for d in deltas)
    assert 2 <= len(reasoning) <= 12 and reasoning.replace(" ", "").isalpha(), reasoning
    assert answer.isupper() and 2 <= len(answer) <= 4, answer
    # Every generated token still comes in a delta, whichever field its text went to.
    usage = responses[-1].final.usage
    assert sum(len(d.token_ids) for d in deltas) == usage.completion_tokens


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"tools": [{**FLAT_WEATHER, "parameters": {"type": "object", "not": {}}}]},
         "tools.0.parameters"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
         "text.format.schema"),
    ],
)  # fmt: skip
def test_responses_bad_requests_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", max_output_tokens=4, **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_grpc_tool_choice_forces_and_returns_the_calls_on_the_final(batch, stub):
    named_text, named = batch["grpc_named"].result()
    _, required = batch["grpc_required"].result()
    for done in (named, required):
        (call,) = done.tool_calls
        assert call.id.startswith("call_") and call.name == "get_weather"
        check(WEATHER["function"]["parameters"], call.arguments)
    # Named: the deltas are the arguments themselves, as the model wrote them.
    assert json.loads(named_text) == json.loads(named.tool_calls[0].arguments)
    bad = build_request(chat=ASKED, max_tokens=4)
    bad.chat.tool_choice.function_name = "get_weather"  # no such tool
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(bad, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.tool_choice" in info.value.details(), info.value.details()


def test_langchain_structured_output_and_a_bound_tool_round_trip(batch):
    assert isinstance(batch["langchain_structured"].result(), Forecast)
    reply, answer = batch["langchain_tools"].result()
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    check(WEATHER["function"]["parameters"], json.dumps(call["args"]))
    assert not answer.tool_calls and answer.response_metadata["finish_reason"] in ("stop", "length")  # fmt: skip
    # The call and its result reached the template: the prompt grew by them.
    assert answer.usage_metadata["input_tokens"] > reply.usage_metadata["input_tokens"]


def test_an_openai_agents_agent_calls_its_function_tool_over_responses(batch):
    calls, result = batch["agent"].result()
    ((city, unit),) = calls
    assert 0 < len(city) <= 10 and unit in ("C", "F")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)


# -- nothing held at idle ---------------------------------------------------------------


def node_metrics(up, name: str) -> dict[tuple[str, str], float]:
    """A node's samples by (sample name, its ``state`` label or "")."""
    with urllib.request.urlopen(up.metrics_url(name), timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    return {(s.name, s.labels.get("state", "")): s.value for f in families for s in f.samples}


def test_no_matcher_or_block_is_held_after_finished_aborted_and_failed_requests(up, client):
    """Requests that finish (the tests above), are dropped mid-stream by their
    client, and fail (their deadline passes on the node): at idle both nodes
    hold no grammar matcher and no KV block."""
    regex = {"guided_regex": "[a-z]{150}"}

    def dropped(remote: bool):
        stream = client.chat.completions.create(
            model=MODEL, messages=messages("Letters.", remote), max_tokens=150, stream=True,
            extra_body=regex | ({"cache_salt": "dropped"} if remote else {}),
        )  # fmt: skip
        next(iter(stream))
        stream.close()  # the client leaves mid-stream

    def timed_out(remote: bool):
        with pytest.raises(openai.APIStatusError):
            client.with_options(timeout=60).chat.completions.create(
                model=MODEL, messages=messages("Letters.", remote), max_tokens=150,
                extra_body=regex | ({"cache_salt": "late"} if remote else {}),
                extra_headers={"x-request-timeout": "0.5"},
            )  # fmt: skip

    in_parallel(lambda job: job[0](job[1]), [(dropped, False), (dropped, True), (timed_out, True)])
    deadline = time.monotonic() + 30
    while True:
        held = {
            name: (m[("pdserve_grammar_matchers", "")], m[("pdserve_kv_blocks", "used")])
            for name in ("prefill-0", "decode-0")
            for m in [node_metrics(up, name)]
        }
        if all(v == (0, 0) for v in held.values()):
            break
        assert time.monotonic() < deadline, f"(matchers, used blocks) still held: {held}"
        time.sleep(0.2)
    # The schemas were compiled once per node and then found in the cache.
    decode = {name: v for (name, _), v in node_metrics(up, "decode-0").items()}
    assert decode["pdserve_grammar_cache_hits_total"] > 0
    compiled = decode["pdserve_grammar_compile_duration_seconds_count"]
    assert compiled == decode["pdserve_grammar_cache_misses_total"] > 0


def test_lora_adapter(client, stub, demo_model_dir, sql_adapter):
    """An adapter named by ``model`` over HTTP and gRPC, prefilled on the decode
    node (short prompt) and on the prefill node (long): each equals the offline
    engine under the same LoRARequest (greedy), and differs from the base
    model's; /v1/models lists it under its parent; unknown models are refused."""
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.sampling_params import SamplingParams

    short, long = "Write a SQL query:", LONG_SYSTEM + "Write a SQL query:"
    offline = LLM(str(demo_model_dir), max_model_len=2048, enable_lora=True)
    lora = LoRARequest("sql", 1, sql_adapter)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    # One batch: the adapter on both prompts and the base model on the short one.
    outputs = offline.generate([short, long, short], greedy, lora_request=[lora, lora, None])
    *want, base = [o.outputs[0] for o in outputs]
    assert base.token_ids != want[0].token_ids, "the adapter changes the output"

    done = client.completions.create(model="sql", prompt=short, max_tokens=8, temperature=0)
    assert done.model == "sql" and done.choices[0].text == want[0].text
    for prompt, expected in zip((short, long), want, strict=True):
        request = build_request(prompt, model="sql", max_tokens=8, temperature=0.0)
        responses = list(stub.Generate(request, timeout=120))
        ids = [t for r in responses for d in r.deltas for t in d.token_ids]
        assert ids == list(expected.token_ids), prompt[:20]
        remote = bool(responses[-1].final.usage.prefill_node)
        assert remote == (prompt is long), "the long prompt is prefilled on the prefill node"

    models = {m.id: m for m in client.models.list().data}
    assert models["sql"].model_extra["parent"] == MODEL
    assert models[MODEL].model_extra["parent"] is None
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt=short, max_tokens=2)
    assert info.value.code == "model_not_found" and "'nope' does not exist" in info.value.message
    request = build_request(short, model="nope", max_tokens=2)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(request, timeout=60))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope' does not exist" in refused.value.details()


def test_lora_adapter_loaded_and_unloaded_at_run_time(client, up, sql_adapter, tmp_path):
    """vLLM's /v1/load_lora_adapter through the official client: a bad path is
    refused on both nodes (404 naming them) and leaves nothing loaded; the
    sql adapter's files under a new name serve a request exactly as "sql"
    does; pdctl lists it on both nodes, in the decode node's device slot; after
    /v1/unload_lora_adapter a request naming it is refused (404)."""
    from router.admin import pdctl

    def post(path: str, body: dict) -> str:
        return client.post(path, body=body, cast_to=str)

    with pytest.raises(openai.NotFoundError) as missing:
        post("/load_lora_adapter", {"lora_name": "sql2", "lora_path": str(tmp_path / "none")})
    assert "prefill-0" in missing.value.message and "decode-0" in missing.value.message
    assert "does not exist" in missing.value.message
    assert "sql2" not in {m.id for m in client.models.list().data}
    loaded = post("/load_lora_adapter", {"lora_name": "sql2", "lora_path": sql_adapter})
    assert loaded == "Success: LoRA adapter 'sql2' added successfully."
    models = {m.id: m for m in client.models.list().data}
    assert models["sql2"].model_extra["parent"] == MODEL
    with pytest.raises(openai.BadRequestError, match="already been loaded"):
        post("/load_lora_adapter", {"lora_name": "sql2", "lora_path": sql_adapter})
    # Under "sql" (the same files) and then under "sql2", each salted (no prefix
    # hit): the same text. Short prompts: the decode node prefills them.
    texts = [
        client.completions.create(
            model=m, prompt="Write a SQL query:", max_tokens=6, temperature=0,
            extra_body={"cache_salt": f"runtime-{m}"},
        ).choices[0].text
        for m in ("sql", "sql2")
    ]  # fmt: skip
    assert texts[1] == texts[0], "the loaded adapter is the sql adapter's weights"
    # Both nodes hold it; the decode node in its one device slot since that
    # request (each heartbeat publishes it: a few reads).
    deadline = time.monotonic() + 5
    while True:
        listed = {a["name"]: a for a in _pdctl_json(pdctl, up, ["lora", "list"])}
        assert sorted(listed["sql2"]["node_ids"]) == ["decode-0", "prefill-0"]
        if listed["sql2"]["resident_node_ids"] == ["decode-0"]:
            break
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
    assert "decode-0" not in listed["sql"]["resident_node_ids"]  # it left the one slot
    removed = post("/unload_lora_adapter", {"lora_name": "sql2"})
    assert removed == "Success: LoRA adapter 'sql2' removed successfully."
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="sql2", prompt="Hi", max_tokens=2)
    assert refused.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="cannot be found"):
        post("/unload_lora_adapter", {"lora_name": "sql2"})


def _pdctl_json(pdctl, up, argv: list[str]):
    """pdctl's --json output of one command against the cluster's admin API."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert pdctl.main(["--address", up.admin, "--json", *argv]) == 0
    return json.loads(out.getvalue())
