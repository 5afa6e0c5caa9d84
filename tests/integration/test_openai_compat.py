"""OpenAI compatibility as clients meet it, on one live `pdserve up --max-model-len
1024 --http-port` (1 prefill, 1 decode node; the router is not told the length):
the official client's and LangChain's default calls, lm-evaluation-harness's
loglikelihood requests replayed, one context length everywhere, OpenAI's error
shapes (issue 50, items 1, 2, 3, 7 and 8's `pdctl nodes`)."""

from __future__ import annotations

import http.client
import json
import time

import grpc
import openai
import pytest

from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from proto.client import build_request
from tests.pdserve_up import UpProcess

pytestmark = pytest.mark.timeout(900)

MAX_LEN = 1024  # the nodes'; the router's own default would be the model's 8192
GRPC_NAMES = {c.name for c in grpc.StatusCode}
# What lm-eval's `local-completions` sends for a loglikelihood request
# (lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload).
LM_EVAL_LOGLIKELIHOOD = {"temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}


@pytest.fixture(scope="module")
def up(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("compat-logs")
    http_port = free_port()
    cluster = UpProcess(
        ["--model", str(demo_model_dir), "--prefill", "1", "--decode", "1"]
        + ["--port", str(free_port()), "--admin-port", str(free_port())]
        + ["--http-port", str(http_port), "--metrics-port", "0"]
        + ["--max-model-len", str(MAX_LEN), "--log-dir", str(logs)],
        # A KV cache of its own size, not one sized from the host's free memory.
        env={"PDSERVE_NUM_KVCACHE_BLOCKS": "512"},
    )
    cluster.wait_ready()
    cluster.http_port = http_port
    yield cluster
    cluster.stop(timeout=60)


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="x", max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def ids(demo_tokenizer):
    """``ids(n)``: a prompt of exactly n token ids."""
    words = demo_tokenizer.encode(" the quick brown fox jumps over a lazy dog")

    def make(n: int) -> list[int]:
        return (words * (n // len(words) + 1))[:n]

    return make


@pytest.fixture(scope="module")
def engine_prompt_logprobs(demo_model_dir):
    """The offline engine's prompt logprobs of a token-id prompt: the oracle."""
    from engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(str(demo_model_dir), max_model_len=MAX_LEN, device="cpu")

    def run(prompt: list[int], k: int = 1):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return out.prompt_logprobs

    return run


def post(up, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        raw = reply.read().decode()
        try:
            return reply.status, json.loads(raw)
        except json.JSONDecodeError:
            return reply.status, raw
    finally:
        conn.close()


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert body["code"] not in GRPC_NAMES, body  # OpenAI's codes, never gRPC's names
    return info.value


# -- item 1: an unset max_tokens means "up to the context left" --------------------------


def test_the_sdks_default_chat_call_is_served(client, model):
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], seed=3
    )
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens + out.usage.completion_tokens <= MAX_LEN


def test_langchain_chat_openai_with_its_defaults(up, model):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="x", model=model)
    reply = llm.invoke("Say hello.", seed=3)
    assert isinstance(reply.content, str)
    assert reply.response_metadata["finish_reason"] in ("stop", "length")


def test_unset_max_tokens_runs_to_the_context_left_on_both_endpoints_and_grpc(
    up, client, model, demo_tokenizer
):
    # One prompt a few tokens short of the context, three ways: a chat, its
    # template's token ids as a completion, and over gRPC (the last two hit
    # the prefix cache the first one filled: a long prompt is slow on a CPU).
    def chat_of(words: int) -> tuple[str, list[int]]:
        content = "x" + " x" * (words - 1)
        text = demo_tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return content, demo_tokenizer.encode(text, add_special_tokens=False)

    base = len(chat_of(1)[1])
    per_word = len(chat_of(2)[1]) - base
    content, prompt = chat_of(1 + (MAX_LEN - 6 - base) // per_word)
    left = MAX_LEN - len(prompt)
    assert 1 <= left <= 12, left
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == left
    assert chat.choices[0].finish_reason == "length"
    # Completions: OpenAI's default is 16 when the field is absent; null is "unset".
    out = client.completions.create(
        model=model, prompt=prompt, extra_body={"max_tokens": None, "ignore_eos": True}
    )
    assert out.usage.completion_tokens == left and out.choices[0].finish_reason == "length"
    with grpc.insecure_channel(up.router) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        request = build_request(token_ids=prompt, ignore_eos=True)
        final = list(stub.Generate(request, timeout=300))[-1].final
    assert final.usage.completion_tokens == left
    assert final.completions[0].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    short = client.completions.create(model=model, prompt="Hi", extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16


# -- item 2: the nodes' max_model_len, everywhere ---------------------------------------------


def test_models_and_every_refusal_say_the_nodes_max_model_len(up, client, model, ids):
    assert client.models.list().data[0].model_extra["max_model_len"] == MAX_LEN
    # Longer than the model's own 8192: refused by the router, which says 1024 too.
    e = error_of(lambda: client.completions.create(model=model, prompt=ids(10_001), max_tokens=4))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded"
    assert f"max_model_len is {MAX_LEN}" in e.body["message"]
    # Fits the nodes' prompt limit but not with its max_tokens: refused, not cut short.
    e = error_of(lambda: client.completions.create(model=model, prompt=ids(977), max_tokens=100))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded"
    assert f"max_model_len {MAX_LEN}" in e.body["message"]
    assert "ask for at most 47 tokens" in e.body["message"]
    with grpc.insecure_channel(up.router) as channel, pytest.raises(grpc.RpcError) as info:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        list(stub.Generate(build_request(token_ids=ids(977), max_tokens=100), timeout=60))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 47 tokens" in info.value.details()


# -- item 3: echo with logprobs, as lm-evaluation-harness asks --------------------------------


def completion_logprobs_shape(lp: dict, n: int) -> None:
    """OpenAI's legacy ``logprobs``: four lists of ``n`` entries, the first
    token (no context) null, offsets each token's start in the echoed text."""
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(v) == n for v in lp.values())
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = lp["text_offset"]
    assert offsets[0] == 0
    assert all(offsets[i + 1] == offsets[i] + len(lp["tokens"][i]) for i in range(n - 1))


def test_lm_eval_loglikelihood_requests_equal_the_engines_prompt_logprobs(
    up, model, demo_tokenizer, engine_prompt_logprobs
):
    context = demo_tokenizer.encode("Question: What is the capital of France?\nAnswer:")
    prompts = [context + demo_tokenizer.encode(c) for c in (" Paris", " London")]
    body = {"model": model, "prompt": prompts, "echo": True, **LM_EVAL_LOGLIKELIHOOD}
    status, reply = post(up, "/v1/completions", body)
    assert status == 200, reply
    scores = []
    for choice, prompt in zip(
        sorted(reply["choices"], key=lambda c: c["index"]), prompts, strict=True
    ):
        lp = choice["logprobs"]
        completion_logprobs_shape(lp, len(prompt) + 1)  # the prompt and the one token
        assert choice["text"].startswith(demo_tokenizer.decode(prompt))
        want = engine_prompt_logprobs(prompt)
        for i in range(1, len(prompt)):
            assert lp["token_logprobs"][i] == pytest.approx(want[i][prompt[i]].logprob, abs=1e-4)
            assert len(lp["top_logprobs"][i]) in (1, 2)  # the best and the prompt's own
            assert max(lp["top_logprobs"][i].values()) >= lp["token_logprobs"][i] - 1e-6
        # lm-eval's parse_logprobs: the continuation's tokens, the generated one left out.
        scores.append(sum(lp["token_logprobs"][len(context) : -1]))
    assert scores[0] > scores[1]  # Paris


def test_echo_with_max_tokens_0_returns_only_the_prompt(client, model, ids):
    prompt = ids(12)
    out = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    lp = out.choices[0].logprobs.model_dump()
    completion_logprobs_shape(lp, len(prompt))
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt)


def test_prompt_logprobs_over_grpc_and_vllms_extra(up, client, model, ids, engine_prompt_logprobs):
    prompt = ids(20)
    want = engine_prompt_logprobs(prompt, k=3)
    with grpc.insecure_channel(up.router) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        request = build_request(token_ids=prompt, max_tokens=2, prompt_logprobs=3)
        responses = list(stub.Generate(request, timeout=120))
    got = [lp for r in responses for lp in r.prompt_logprobs]
    assert [g.token_id for g in got] == prompt[1:]
    for g, w, token in zip(got, want[1:], prompt[1:], strict=True):
        assert g.logprob == pytest.approx(w[token].logprob, abs=1e-4)
        assert len(g.top) >= 3
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 3}
    )
    extra = out.choices[0].model_extra["prompt_logprobs"]
    assert extra[0] is None and len(extra) == len(prompt)
    assert extra[5][str(prompt[5])]["logprob"] == pytest.approx(
        want[5][prompt[5]].logprob, abs=1e-4
    )


# -- vLLM's return_token_ids: the prompt's and the reply's token ids ------------------------


CHAT = [{"role": "user", "content": "Name three colours."}]


def grpc_ids(up, **request) -> list[int]:
    """The reply's token ids over gRPC: the oracle the HTTP edge must equal."""
    with grpc.insecure_channel(up.router) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        responses = list(stub.Generate(build_request(**request), timeout=300))
    return [t for r in responses for d in r.deltas for t in d.token_ids]


def no_token_ids(choice, response) -> None:
    """As vLLM without return_token_ids: neither field."""
    for obj in (choice, response):
        assert not {"token_ids", "prompt_token_ids"} & set(obj.model_extra or {}), obj


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_return_token_ids_as_vllm(up, client, model, demo_tokenizer, stream):
    prompt = "The capital of France is"
    want = grpc_ids(up, prompt=prompt, max_tokens=12, temperature=0.0)
    assert len(want) == 12
    kwargs = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    asked = client.completions.create(
        **kwargs, stream=stream, extra_body={"return_token_ids": True}
    )
    if stream:
        chunks = [c.choices[0] for c in asked]
        got = [t for c in chunks for t in c.token_ids]  # every chunk has the key (vLLM's)
        text = "".join(c.text for c in chunks)
        prompt_ids = chunks[0].prompt_token_ids
        assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    else:
        got, text = asked.choices[0].token_ids, asked.choices[0].text
        prompt_ids = asked.choices[0].prompt_token_ids  # on the choice, for completions
        assert "prompt_token_ids" not in asked.model_extra
    assert got == want
    assert demo_tokenizer.decode(got, skip_special_tokens=True) == text
    assert prompt_ids == demo_tokenizer.encode(prompt)
    # A stop token ends the reply and stays in its ids, not in its text (as vLLM).
    stop = want[3]
    cut = client.completions.create(
        **kwargs, extra_body={"return_token_ids": True, "stop_token_ids": [stop]}
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.token_ids == want[: want.index(stop) + 1]
    assert demo_tokenizer.decode(cut.token_ids[:-1], skip_special_tokens=True) == cut.text
    for extra in ({"return_token_ids": False}, {}):
        plain = client.completions.create(**kwargs, stream=stream, extra_body=extra)
        for out in plain if stream else [plain]:
            no_token_ids(out.choices[0], out)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_returns_token_ids_as_vllm(up, client, model, demo_tokenizer, stream):
    want = grpc_ids(up, chat=CHAT, max_tokens=16, temperature=0.0)
    templated = demo_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    kwargs = {"model": model, "messages": CHAT, "max_tokens": 16, "temperature": 0}
    asked = client.chat.completions.create(
        **kwargs, stream=stream, extra_body={"return_token_ids": True}
    )
    if stream:
        chunks = list(asked)
        # The role chunk carries the prompt's ids, beside its choices; no other does.
        assert chunks[0].choices[0].delta.role == "assistant"
        prompt_ids = chunks[0].prompt_token_ids
        assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
        # Each later chunk's choice (not its delta) carries that chunk's new ids.
        choices = [c.choices[0] for c in chunks[1:]]
        got = [t for c in choices for t in c.token_ids]
        text = "".join(c.delta.content or "" for c in choices)
    else:
        prompt_ids = asked.prompt_token_ids  # on the response, for chat
        got, text = asked.choices[0].token_ids, asked.choices[0].message.content
    assert got == want
    assert demo_tokenizer.decode(got, skip_special_tokens=True) == text
    assert prompt_ids == demo_tokenizer.encode(templated, add_special_tokens=False)
    for extra in ({"return_token_ids": False}, {}):
        plain = client.chat.completions.create(**kwargs, stream=stream, extra_body=extra)
        for out in plain if stream else [plain]:
            for choice in out.choices:
                no_token_ids(choice, out)


def test_return_token_ids_with_n_and_a_batch_of_prompts(client, model, demo_tokenizer):
    prompts = ["Once upon a time", "The sky is"]
    out = client.completions.create(
        model=model, prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=7,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    for c in out.choices:
        assert c.prompt_token_ids == demo_tokenizer.encode(prompts[c.index // 2])
        assert len(c.token_ids) == 6
        assert demo_tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text
    streamed: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    firsts: dict[int, list[int]] = {}
    for chunk in client.chat.completions.create(
        model=model, messages=CHAT, n=2, max_tokens=8, temperature=1.0, seed=7, stream=True,
        extra_body={"return_token_ids": True},
    ):  # fmt: skip
        c = chunk.choices[0]
        if c.delta.role:
            firsts[c.index] = chunk.prompt_token_ids
            continue
        streamed.setdefault(c.index, []).extend(c.token_ids)
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    templated = demo_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt_ids = demo_tokenizer.encode(templated, add_special_tokens=False)
    assert firsts == {0: prompt_ids, 1: prompt_ids}
    assert sorted(streamed) == [0, 1]
    for i, ids in streamed.items():
        assert demo_tokenizer.decode(ids, skip_special_tokens=True) == texts[i]


def test_responses_refuse_return_token_ids(up, model):
    body = {"model": model, "input": "Hi", "return_token_ids": True}
    status, reply = post(up, "/v1/responses", body)
    assert status == 400 and reply["error"]["param"] == "return_token_ids", reply


# -- item 7: OpenAI's error shapes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"prompt": "Hi", "extra_body": {"guided_regex": "a(b"}}, "guided_regex", "not a valid regex"),
        ({"prompt": "Hi", "extra_body": {"structured_outputs": {"json": {}, "regex": "a"}}},
         "structured_outputs", "exactly one"),
        ({"prompt": "Hi", "extra_body": {"use_beam_search": True}}, "use_beam_search", "not"),
    ],
)  # fmt: skip
def test_completion_refusals_have_openai_shapes(client, model, kwargs, param, words):
    e = error_of(lambda: client.completions.create(model=model, **kwargs))
    assert e.status_code == 400 and e.body["type"] == "invalid_request_error"
    assert e.body["param"] == param and words in e.body["message"]


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]}]},
         "messages.0.content.1", "images are not supported by this model"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "not supported"),
        ({"function_call": "auto"}, "function_call", "not supported"),
        ({"modalities": ["text", "audio"]}, "modalities", "audio"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "not a valid regex"),
    ],
)  # fmt: skip
def test_chat_refusals_have_openai_shapes(client, model, kwargs, param, words):
    kwargs.setdefault("messages", [{"role": "user", "content": "Hi"}])
    e = error_of(lambda: client.chat.completions.create(model=model, max_tokens=2, **kwargs))
    assert e.status_code == 400 and e.body["type"] == "invalid_request_error"
    assert e.body["param"] == param and words in e.body["message"]


def test_an_error_mid_stream_has_openais_four_fields(up, model):
    body = {"model": model, "prompt": "Tell me a story.", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=300)
    try:
        headers = {"Content-Type": "application/json", "X-Request-Timeout": "6"}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        reply = conn.getresponse()
        assert reply.status == 200  # the stream began: the deadline ends it mid-way
        events = [
            line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")
        ]
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] not in GRPC_NAMES


# -- item 8: `pdctl nodes` right after a request ----------------------------------------------------


# A node that goes idle beats at once, not at its next beat (every 0.5 s by
# default): well before that, nothing reads as running. Nothing waits for the
# beat, so the answer may reach the client a moment before it lands.
IDLE_SEEN_WITHIN_S = 0.2


def test_nodes_show_no_running_request_once_the_answer_came(up, client, model):
    def running() -> list[tuple[str, int]]:
        with grpc.insecure_channel(up.admin) as channel:
            listed = admin_pb2_grpc.AdminStub(channel).ListNodes(
                admin_pb2.ListNodesRequest(), timeout=10
            )
        return [(n.node_id, n.running) for n in listed.nodes if n.running]

    for _ in range(3):
        client.completions.create(model=model, prompt="Hello", max_tokens=3)
        answered = time.monotonic()
        while (seen := running()) and time.monotonic() - answered < IDLE_SEEN_WITHIN_S:
            time.sleep(0.01)
        assert seen == []
        time.sleep(0.3)


# -- vLLM's continue_final_message, chat_template and bad_words ---------------------------


QUESTION = {"role": "user", "content": "What is the capital of France?"}
PREFILLED = [QUESTION, {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def engine_greedy(demo_model_dir):
    """The offline engine's greedy text for token ids: the oracle."""
    from engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(str(demo_model_dir), max_model_len=MAX_LEN, device="cpu")

    def run(prompt: list[int], max_tokens: int, **params) -> str:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
        return out.outputs[0].text

    return run


def test_continue_final_message_continues_the_assistants_text(
    client, model, demo_tokenizer, engine_greedy
):
    out = client.chat.completions.create(
        model=model,
        messages=PREFILLED,
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    # transformers' rendering, the assistant's message left open (vLLM's own call).
    text = demo_tokenizer.apply_chat_template(
        PREFILLED, continue_final_message=True, tokenize=False
    )
    assert text.endswith("assistant\nThe capital of France is")
    prompt = demo_tokenizer.encode(text, add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt)
    reply = out.choices[0].message.content
    assert reply == engine_greedy(prompt, 8)
    assert "Paris" in reply and "capital" not in reply  # it goes on; it does not start over


def test_continue_final_message_with_a_generation_prompt_is_vllms_400(client, model):
    for extra in ({"add_generation_prompt": True}, {}):  # unset, it is true
        error = error_of(
            lambda extra=extra: client.chat.completions.create(
                model=model,
                messages=PREFILLED,
                max_tokens=4,
                extra_body={"continue_final_message": True, **extra},
            )
        )
        assert error.status_code == 400 and error.body["param"] == "continue_final_message"
        assert error.body["message"] == (
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )


def test_a_requests_chat_template_is_refused_without_the_routers_trust(client, model):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    # The field, and vLLM's other way to pass one: chat_template_kwargs' chat_template.
    for extra, param in (
        ({"chat_template": template}, "chat_template"),
        ({"chat_template_kwargs": {"chat_template": template}}, "chat_template_kwargs"),
    ):
        error = error_of(
            lambda extra=extra: client.chat.completions.create(
                model=model, messages=[QUESTION], max_tokens=4, extra_body=extra
            )
        )
        assert error.status_code == 400 and error.body["param"] == param
        assert "--trust-request-chat-template is not set" in error.body["message"]


def test_bad_words_are_never_written_on_both_endpoints(
    client, model, demo_tokenizer, engine_greedy
):
    prompt = "The capital of France is"
    kwargs = {"model": model, "max_tokens": 8, "temperature": 0}
    free = client.completions.create(prompt=prompt, **kwargs).choices[0].text
    assert " Paris" in free  # greedily, the model writes it
    banned = client.completions.create(prompt=prompt, extra_body={"bad_words": ["Paris"]}, **kwargs)
    text = banned.choices[0].text
    assert "Paris" not in text
    assert text == engine_greedy(demo_tokenizer.encode(prompt), 8, bad_words=["Paris"])
    # Two tokens (" answer", " is"): the second is banned only right after the first.
    free = client.completions.create(prompt=prompt, **{**kwargs, "max_tokens": 12})
    assert " answer is" in free.choices[0].text
    two = client.completions.create(
        prompt=prompt, extra_body={"bad_words": ["answer is"]}, **{**kwargs, "max_tokens": 12}
    )
    assert " answer" in two.choices[0].text and " answer is" not in two.choices[0].text

    chat = {"messages": [QUESTION], **kwargs}
    assert "Paris" in client.chat.completions.create(**chat).choices[0].message.content
    reply = client.chat.completions.create(**chat, extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in reply.choices[0].message.content
