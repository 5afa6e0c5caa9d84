"""The OpenAI HTTP API through the official `openai` client, on a live cluster
(`pdserve up --http-port` style: real processes, a real redis-server)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time

import grpc
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.grpc_server import health_check
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc
from proto.client import generate_text

pytestmark = pytest.mark.timeout(900)

MAX_LEN = 512
ALICE = "alice-generate-0123456789"  # generate
VIEWER = "viewer-admin-read-0123456789"  # admin:read, no generate
OPS = "ops-everything-0123456789"  # generate,admin: lists the nodes' blocks
PROMPT = "The capital of France is"
CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three primary colours."},
]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("openai")
    tokens = work / "tokens"
    tokens.write_text(
        f"alice generate {ALICE}\nviewer admin:read {VIEWER}\nops generate,admin {OPS}\n"
    )
    spec = ClusterSpec(
        model=str(demo_model_dir),
        num_prefill=1,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        http_port=free_port(),
        engine_args=["--max-model-len", str(MAX_LEN)],
        # max-in-flight 1: a second request while one streams gets 429.
        router_args=[
            "--max-model-len",
            str(MAX_LEN),
            "--api-tokens-file",
            str(tokens),
            "--max-in-flight",
            "1",
        ],
        log_dir=str(work / "logs"),
        start_timeout_s=300,
    )
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.http_ports[0]}/v1"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=ALICE, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(demo_model_dir, demo_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()

    def greedy(ids: list[int], n: int) -> str:
        with torch.no_grad():
            out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        return demo_tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    return greedy


def nodes(cluster) -> list:
    auth = (("authorization", f"Bearer {OPS}"),)
    with grpc.insecure_channel(cluster.admin_address) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        return list(stub.ListNodes(admin_pb2.ListNodesRequest(), timeout=5, metadata=auth).nodes)


def wait_all_blocks_free(cluster) -> list:
    auth = (("authorization", f"Bearer {OPS}"),)
    deadline = time.monotonic() + 10
    while True:
        with grpc.insecure_channel(cluster.admin_address) as ch:
            nodes = (
                admin_pb2_grpc.AdminStub(ch)
                .ListNodes(admin_pb2.ListNodesRequest(), timeout=5, metadata=auth)
                .nodes
            )
        if all(n.kv_blocks_free == n.kv_blocks_total and n.running == 0 for n in nodes):
            return list(nodes)
        if time.monotonic() > deadline:
            pytest.fail(f"blocks still held: {[(n.node_id, n.kv_blocks_free) for n in nodes]}")
        time.sleep(0.2)


def test_models_lists_the_served_model(client, model):
    data = client.models.list().data
    assert [m.id for m in data] == [model]
    assert data[0].model_extra["max_model_len"] == MAX_LEN


def test_greedy_completion_equals_grpc_and_hf(cluster, client, model, hf, demo_tokenizer):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    text = out.choices[0].text
    grpc_text, final = generate_text(
        cluster.router_address, PROMPT, max_tokens=12, temperature=0.0, token=ALICE, timeout=120
    )
    assert text == grpc_text
    assert text == hf(demo_tokenizer.encode(PROMPT), 12)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == final.usage.prompt_tokens
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    assert out.id.startswith("cmpl-") and out.model == model and out.created > 0


def test_greedy_chat_equals_grpc_and_hf(cluster, client, model, hf, demo_tokenizer):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    grpc_text, _ = generate_text(
        cluster.router_address, chat=CHAT, max_tokens=16, temperature=0.0, token=ALICE, timeout=120
    )
    ids = demo_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out.choices[0].message.content == grpc_text
    assert grpc_text == hf(demo_tokenizer.encode(ids, add_special_tokens=False), 16)
    assert out.choices[0].message.role == "assistant"


def test_token_id_prompts_and_batches(client, model, demo_tokenizer):
    ids = demo_tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    batch = client.completions.create(
        model=model, prompt=[ids, ids], max_tokens=6, temperature=0, echo=True
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.index for c in batch.choices] == [0, 1]
    assert all(c.text == PROMPT + by_text.choices[0].text for c in batch.choices)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_equals_non_streamed_with_usage(client, model, chat):
    if chat:
        kw = dict(model=model, messages=CHAT, max_tokens=16, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        stream = client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    else:
        kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
        whole = client.completions.create(**kw).choices[0].text
        stream = client.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append((c.delta.content or "") if chat else c.text)
            finish = c.finish_reason or finish
    assert "".join(parts) == whole
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 16
    assert usage.total_tokens == usage.prompt_tokens + 16


def test_no_usage_chunk_unless_asked(client, model):
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_n2_with_logprobs(client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, n=2, logprobs=3, seed=7, temperature=1.0
    )
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert "".join(lp.tokens) == c.text
        assert all(v <= 0 for v in lp.token_logprobs)
        # The 3 best, plus the sampled token when it is not among them (as vLLM).
        assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    assert out.usage.completion_tokens == 10


def test_chat_n2_with_top_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=4, n=2, logprobs=True, top_logprobs=2
    )
    assert len(out.choices) == 2
    for c in out.choices:
        content = c.logprobs.content
        assert len(content) == 4
        assert "".join(t.token for t in content) == c.message.content
        assert all(len(t.top_logprobs) == 2 for t in content)
        # Greedy's pick is the best: the first top logprob is at least the chosen one's.
        assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-4 for t in content)


def test_stop_string_finishes_with_stop(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    word = whole.choices[0].text.split()[1]
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[word]
    )
    assert out.choices[0].finish_reason == "stop"
    assert word not in out.choices[0].text


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.body
    assert set(body) >= {"message", "type", "param", "code"}, body
    return info.value


def test_error_statuses(cluster, client, model):
    e = error_of(lambda: client.completions.create(model=model, prompt=PROMPT, temperature=-1))
    assert e.status_code == 400 and e.body["param"] == "temperature"
    e = error_of(lambda: client.completions.create(model=model, prompt=PROMPT, n="x"))
    assert e.status_code == 400 and e.body["param"] == "n"
    e = error_of(lambda: client.chat.completions.create(model=model, messages=[{"role": "robot"}]))
    assert e.status_code == 400 and e.body["param"].startswith("messages.0.role")
    e = error_of(lambda: client.completions.create(model=model, prompt="word " * (MAX_LEN + 10)))
    assert e.status_code == 400 and e.body["code"] == "context_length_exceeded"
    e = error_of(lambda: client.completions.create(model="no-such-model", prompt=PROMPT))
    assert e.status_code == 404 and e.body["code"] == "model_not_found"
    # The client refuses to send no key at all: a bare request does.
    status, reply = post(cluster, "/v1/completions", b'{"prompt": "Hi"}', token=None)
    assert status == 401 and json.loads(reply)["error"]["type"] == "authentication_error"
    e = error_of(lambda: client.with_options(api_key="not-a-known-token").models.list())
    assert e.status_code == 401
    e = error_of(
        lambda: client.with_options(api_key=VIEWER).completions.create(model=model, prompt=PROMPT)
    )
    assert e.status_code == 403
    e = error_of(
        lambda: client.with_options(max_retries=0).completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=400,
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-timeout": "0.5"},
        )
    )
    assert e.status_code == 504


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b'{"prompt": {"a": 1}}',
        b'{"prompt": "x", "max_tokens": 1e400}',
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "logit_bias": {"a": 1}}',
        b'{"prompt": [], "max_tokens": 2}',
        b'{"prompt": [[99999999999999999999999]]}',
    ],
)
def test_malformed_bodies_are_400(cluster, body):
    status, reply = post(cluster, "/v1/completions", body)
    assert status == 400, reply
    assert set(json.loads(reply)["error"]) == {"message", "type", "param", "code"}


def test_health_version_and_http_metrics(cluster):
    assert get(cluster, "/health")[0] == 200
    assert "version" in json.loads(get(cluster, "/version")[1])
    status, body = get(cluster, "/v1/nothing-here")
    assert status == 404 and "error" in json.loads(body)
    metrics = router_metrics(cluster)
    assert 'pdserve_router_http_requests_total{endpoint="/v1/completions",status="400"}' in metrics
    assert 'pdserve_router_http_requests_total{endpoint="/v1/completions",status="200"}' in metrics


def test_disconnect_mid_stream_frees_every_block_and_a_busy_router_says_429(cluster, client, model):
    stream = client.completions.create(
        model=model,
        prompt="Tell me a long story.",
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += sum(bool(c.text) for c in chunk.choices)
        if received >= 3:
            break
    # --max-in-flight 1 and this stream in flight: no capacity.
    e = error_of(lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2))
    assert e.status_code == 429 and e.response.headers["retry-after"]
    # The nodes publish their free blocks with each heartbeat: wait for one.
    deadline = time.monotonic() + 10
    while not any(
        n.role == "decode" and n.kv_blocks_free < n.kv_blocks_total for n in nodes(cluster)
    ):
        assert time.monotonic() < deadline, "the stream's blocks never showed"
        time.sleep(0.1)
    stream.close()  # the client goes away mid-stream
    wait_all_blocks_free(cluster)
    # The slot is free again too.
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices


def test_disconnect_before_a_non_streamed_answer_frees_every_block(cluster):
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_ports[0], timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {ALICE}"})
    auth = (("authorization", f"Bearer {OPS}"),)
    deadline = time.monotonic() + 30
    while True:  # until the decode node holds the request's blocks
        with grpc.insecure_channel(cluster.admin_address) as ch:
            nodes = (
                admin_pb2_grpc.AdminStub(ch)
                .ListNodes(admin_pb2.ListNodesRequest(), timeout=5, metadata=auth)
                .nodes
            )
        if any(n.role == "decode" and n.running for n in nodes):
            break
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away before any byte came back
    conn.close()
    wait_all_blocks_free(cluster)


def test_no_node_is_503(cluster, demo_model_dir, tmp_path):
    """A router over an empty cluster (another Redis database: no nodes)."""
    port, http_port = free_port(), free_port()
    log = (tmp_path / "router.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "router", "--model", str(demo_model_dir),
         "--redis-url", cluster.redis_url.rsplit("/", 1)[0] + "/9", "--host", "127.0.0.1",
         "--port", str(port), "--admin-port", str(free_port()), "--http-port", str(http_port),
         "--metrics-port", "0"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not health_check(f"127.0.0.1:{port}", timeout=0.5):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.3)
        empty = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0
        )
        e = error_of(
            lambda: empty.completions.create(model=empty.models.list().data[0].id, prompt="Hi")
        )
        assert e.status_code == 503
    finally:
        proc.terminate()
        proc.wait(30)


# -- the HTTP edge, fuzzed ---------------------------------------------------------

FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stream",
          "stream_options", "logprobs", "top_logprobs", "echo", "stop", "seed", "logit_bias",
          "top_k", "min_p", "min_tokens", "ignore_eos", "stop_token_ids", "presence_penalty"]  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)  # fmt: skip
BODIES = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
    st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=6))},
        optional={f: JSON for f in FIELDS if f != "prompt"},
    ),
)


def post(cluster, path: str, body: bytes, token: str | None = ALICE) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_ports[0], timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        conn.request("POST", path, body, headers)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def get(cluster, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_ports[0], timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {ALICE}"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def router_metrics(cluster) -> str:
    router = next(c for c in cluster.components if c.name == "router")
    conn = http.client.HTTPConnection("127.0.0.1", router.metrics_port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans())
def test_fuzzed_bodies_never_5xx_never_hang(cluster, body, chat):
    if isinstance(body, dict):
        # Bounded work per example: an int max_tokens stays small (others are refused).
        if body.get("max_tokens") is None:
            body["max_tokens"] = 3
        if isinstance(body["max_tokens"], int):
            body["max_tokens"] = max(-1, min(body["max_tokens"], 3))
        if isinstance(body.get("n"), int):
            body["n"] = min(body["n"], 3)
        body.pop("model", None) if not isinstance(body.get("model"), str) else None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    for _ in range(20):  # 429 (the one slot is busy) is a fine answer, but retry for coverage
        status, reply = post(cluster, path, json.dumps(body).encode())
        if status != 429:
            break
        time.sleep(0.1)
    assert status < 500, (status, reply)
    if status >= 400:
        assert set(json.loads(reply)["error"]) == {"message", "type", "param", "code"}
