"""A real cluster on the CPU: 1 router + 2 prefill + 2 decode nodes as separate
processes, a real redis-server, KV over gloo channels (started the way
`pdserve up` starts them), every process exporting its spans to an OTLP
collector of the test's own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.cluster.state import Cluster, NodeRole
from common.grpc_server import health_check
from engine import LLM, SamplingParams
from engine.block_hash import hash_prompt_blocks
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from proto.client import agenerate, generate, generate_text
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.otlp_collector import Collector

pytestmark = pytest.mark.timeout(600)

MAX_LEN = 1024
PROMPTS = [
    "The history of the printing press begins",
    "Write a haiku about autumn.",
    "def fibonacci(n):",
    "List three primary colors:",
    "Once upon a time in a quiet village,",
    "The speed of light is",
    "Explain recursion to a child.",
    "Les mathématiques sont",
    "What is the boiling point of water?",
    "A short poem about the sea:",
    "import numpy as np\n",
    "The three laws of motion are",
    "My favourite food is",
    "Translate 'good morning' into Spanish:",
    "The capital of Japan is",
    "Count from one to ten:",
]


# The spans' batches leave every 100 ms (the SDK's default: 5 s).
SPANS_SOON = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def collector():
    with Collector() as c:
        yield c


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory, collector):
    names = ["router", "prefill-0", "prefill-1", "decode-0", "decode-1"]
    spec = ClusterSpec(
        model=str(demo_model_dir),
        num_prefill=2,
        num_decode=2,
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", str(MAX_LEN)],
        node_args=["--verify-kv", "--heartbeat-interval", "0.2"]
        + ["--otlp-endpoint", collector.endpoint],
        # Always disaggregate: these tests exercise the KV transfer on short
        # prompts, which the default policy would prefill on the decode node
        # (tests/integration/test_routing.py runs the defaults).
        router_args=[*REMOTE_PREFILL_ONLY, "--otlp-endpoint", collector.endpoint],
        component_env={name: SPANS_SOON for name in names},
        log_dir=str(tmp_path_factory.mktemp("cluster-logs")),
        start_timeout_s=300,
    )
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def offline(demo_model_dir):
    return LLM(str(demo_model_dir), max_model_len=MAX_LEN, device="cpu")


def list_nodes(cluster) -> list[admin_pb2.NodeInfo]:
    with grpc.insecure_channel(cluster.admin_address) as ch:
        return list(
            admin_pb2_grpc.AdminStub(ch).ListNodes(admin_pb2.ListNodesRequest(), timeout=5).nodes
        )


def redis_nodes(cluster):
    async def go():
        c = Cluster.from_url(cluster.redis_url)
        try:
            return await c.nodes()
        finally:
            await c.close()

    return asyncio.run(go())


def collect(address, prompt, **kw):
    tokens, text, final = [], [], None
    for r in generate(address, prompt, timeout=120, **kw):
        assert len({d.index for d in r.deltas}) == len(r.deltas)  # one entry per completion
        for d in r.deltas:
            tokens.extend(d.token_ids)
            text.append(d.text)
        if r.HasField("final"):
            final = r.final
    return tokens, "".join(text), final


def test_every_component_is_serving(cluster):
    for c in cluster.components:
        assert health_check(c.address), c.name
    assert health_check(cluster.router_address, "pdserve.v1.Router")
    assert health_check(cluster.admin_address, "pdserve.v1.Admin")
    nodes = list_nodes(cluster)
    assert sorted((n.node_id, n.role) for n in nodes) == [
        ("decode-0", "decode"),
        ("decode-1", "decode"),
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
    ]
    assert all(n.kv_blocks_total > 0 and n.heartbeat_age_ms < 5000 for n in nodes)


def test_sixteen_concurrent_streams_match_the_offline_engine(cluster, offline):
    params = dict(temperature=0.0, max_tokens=24)
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, SamplingParams(**params))]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: collect(cluster.router_address, p, **params), PROMPTS))
    for (tokens, text, final), ref in zip(results, expected, strict=True):
        assert tokens == ref.token_ids
        assert text == ref.text
        assert final.usage.completion_tokens == len(ref.token_ids)
        assert final.usage.prompt_tokens > 0
        assert final.usage.prefill_node.startswith("prefill-")  # prefilled remotely
        assert final.usage.decode_node.startswith("decode-")
        # The disaggregated path hop by hop on the decode node: its admission,
        # the wait for the KV, the first output.
        t = final.usage.timing
        assert t.decode_admit_ms > 0 and t.kv_wait_ms > 0 and t.decode_first_output_ms > 0
        # The prefill node's own figures, where its reply came before the Final
        # (nothing waits for it): its part holds the prompt's queue and compute.
        if t.prefill_node_ms:
            assert t.prefill_node_ms >= t.prefill_queue_ms + t.prefill_compute_ms
    # Replies come about with the first token: 24 tokens later they are in.
    assert sum(r[2].usage.timing.prefill_node_ms > 0 for r in results) >= len(results) // 2
    # Both decode nodes and both prefill nodes took work.
    assert {r[2].usage.decode_node for r in results} == {"decode-0", "decode-1"}
    assert {r[2].usage.prefill_node for r in results} == {"prefill-0", "prefill-1"}


def test_landed_kv_is_bit_identical_to_what_the_prefill_node_sent(cluster):
    # Every transfer in this cluster is checksummed by both sides (--verify-kv):
    # the prefill node hashes the bytes it gathered, the decode node hashes its
    # blocks after the scatter; a mismatch fails the request.
    collect(cluster.router_address, "Checksum this transfer, please.", max_tokens=2)
    time.sleep(0.6)
    nodes = {n.node_id: n for n in redis_nodes(cluster)}
    landed = sum(n.kv_transfers for n in nodes.values() if n.role is NodeRole.DECODE)
    sent = sum(n.kv_transfers for n in nodes.values() if n.role is NodeRole.PREFILL)
    assert landed >= 1 and landed == sent
    assert all(
        n.kv_checksum_mismatches == 0 and n.kv_transfer_failures == 0 for n in nodes.values()
    )


def test_a_repeated_long_prefix_goes_to_the_prefill_node_that_cached_it(cluster, demo_tokenizer):
    for i in range(3):
        prefix = f"Case {i}: " + " ".join(f"fact-{i}-{j} about the archive" for j in range(40))
        _, _, first = collect(cluster.router_address, prefix + " Question one?", max_tokens=2)
        owner = first.usage.prefill_node
        time.sleep(0.6)  # a heartbeat publishes the new blocks
        ids = demo_tokenizer.encode(prefix)
        hashes = hash_prompt_blocks(ids, "smollm2-135m-instruct", 16)
        assert len(hashes) >= 10

        async def blocks(node):
            c = Cluster.from_url(cluster.redis_url)
            try:
                return await c.node_blocks(node)
            finally:
                await c.close()

        owned = asyncio.run(blocks(owner))
        other = asyncio.run(blocks({"prefill-0": "prefill-1", "prefill-1": "prefill-0"}[owner]))
        assert set(hashes) <= owned and not set(hashes) & other
        _, _, second = collect(cluster.router_address, prefix + " Question two?", max_tokens=2)
        assert second.usage.prefill_node == owner
        assert second.usage.cached_tokens >= 16 * len(hashes) - 16


def test_an_expired_deadline_frees_blocks_everywhere(cluster):
    with pytest.raises(grpc.RpcError) as info:
        collect_with_timeout = list(
            generate(
                cluster.router_address,
                "Tell me a very long story.",
                max_tokens=800,
                ignore_eos=True,
                timeout=1.5,
            )
        )
        assert not collect_with_timeout
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        nodes = list_nodes(cluster)
        if all(n.kv_blocks_free == n.kv_blocks_total and n.running == 0 for n in nodes):
            return
        time.sleep(0.2)
    pytest.fail(
        f"blocks still held after the deadline: {[(n.node_id, n.kv_blocks_free) for n in nodes]}"
    )


def test_client_cancel_frees_blocks_on_every_node(cluster):
    async def start_and_cancel():
        stream = agenerate(
            cluster.router_address,
            "Tell me a very long story about dragons.",
            max_tokens=600,
            ignore_eos=True,
            timeout=120,
        )
        async for response in stream:
            if response.deltas:
                break
        await asyncio.sleep(0.6)
        busy = list_nodes(cluster)
        await stream.aclose()  # the client goes away mid-stream
        return busy

    busy = asyncio.run(start_and_cancel())
    assert any(n.role == "decode" and n.kv_blocks_free < n.kv_blocks_total for n in busy)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        nodes = list_nodes(cluster)
        if all(n.kv_blocks_free == n.kv_blocks_total and n.running == 0 for n in nodes):
            break
        time.sleep(0.2)
    else:
        pytest.fail(
            f"blocks still held after cancel: {[(n.node_id, n.kv_blocks_free, n.kv_blocks_total) for n in nodes]}"
        )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop_token_ids=[10**9]), "stop_token_ids"),
        (dict(n=100_000), "max_num_seqs"),  # found by tests/faults/test_bad_input.py
    ],
)
def test_bad_requests_get_invalid_argument_naming_the_problem(cluster, kwargs, message):
    with pytest.raises(grpc.RpcError) as info:
        generate_text(cluster.router_address, "hello", timeout=30, **kwargs)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_bad_prompts(cluster):
    for kwargs, message in (
        (dict(token_ids=[1, 2, -5]), "outside the vocabulary"),
        (dict(token_ids=[]), "empty"),
        (dict(token_ids=[5] * (MAX_LEN + 3)), "max_model_len"),
        (dict(chat=[]), "no messages"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            generate_text(cluster.router_address, timeout=30, **kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
        assert message in info.value.details()


def test_generate_command(cluster):
    cli = [sys.executable, "-m", "pdserve.cli", "generate", "--address", cluster.router_address]
    ok = subprocess.run(
        [*cli, "What is the capital of France?", "--chat", "--max-tokens", "20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "Paris" in ok.stdout
    assert "completion tokens" in ok.stderr and "prefill: prefill-" in ok.stderr
    bad = subprocess.run(
        [*cli, "hi", "--temperature", "-3"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("pdserve: error: INVALID_ARGUMENT")
    down = subprocess.run(
        [*cli[:-1], f"127.0.0.1:{free_port()}", "hi", "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_pdctl_nodes(cluster):
    import json as _json

    cli = [sys.executable, "-m", "router.admin.pdctl", "--address", cluster.admin_address]
    table = subprocess.run([*cli, "nodes"], capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["NODE", "ROLE"] and len(lines) == 5
    as_json = subprocess.run([*cli, "--json", "nodes"], capture_output=True, text=True, timeout=60)
    nodes = _json.loads(as_json.stdout)
    assert sorted(n["node_id"] for n in nodes) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    down = subprocess.run(
        [
            sys.executable,
            "-m",
            "router.admin.pdctl",
            "--address",
            f"127.0.0.1:{free_port()}",
            "--timeout",
            "2",
            "nodes",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        down.returncode == 3
        and down.stderr.strip().startswith("pdctl: error:")
        and "unreachable" in down.stderr
    )


def test_final_message_and_request_id_echo(cluster):
    responses = list(
        generate(
            cluster.router_address, "Hi there", request_id="client-42", max_tokens=3, timeout=60
        )
    )
    assert all(r.request_id == "client-42" for r in responses)
    final = responses[-1]
    assert final.HasField("final") and len(final.final.completions) == 1
    assert not any(r.HasField("final") for r in responses[:-1])
    # One message per step: 3 tokens -> at most 3 messages (the last with the Final).
    assert len(responses) <= 3 and sum(len(d.token_ids) for r in responses for d in r.deltas) <= 3
    assert final.final.completions[0].finish_reason in (
        pdserve_pb2.FINISH_REASON_STOP,
        pdserve_pb2.FINISH_REASON_LENGTH,
    )
    assert final.final.usage.time_to_first_token_ms > 0


def test_a_request_is_one_trace_across_router_decode_and_prefill_nodes(cluster, collector):
    """The client's trace context (gRPC metadata) is the router's span's parent;
    the decode and prefill nodes' spans are the router's children, each with its
    phases, all of one trace, exported by each process over OTLP."""
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_id}-{client_span}-01"),)
    request = pdserve_pb2.GenerateRequest(prompt="Trace me: the tides are", request_id="traced")
    request.sampling.max_tokens = 4
    stub = pdserve_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    final = list(stub.Generate(request, metadata=metadata, timeout=60))[-1].final
    assert final.usage.prefill_node  # disaggregated

    def complete(spans) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return {"request", "decode", "prefill", "kv_wait", "compute"} <= names

    spans = [s for s in collector.wait_for(complete) if s.trace_id == trace_id]
    by_name = {s.name: s for s in spans}
    root = by_name["request"]
    assert root.service == "pdserve-router" and root.parent_id == client_span
    assert root.attributes["pdserve.status"] == "OK"
    assert root.attributes["pdserve.prefill_node"] == final.usage.prefill_node
    decode, prefill = by_name["decode"], by_name["prefill"]
    assert decode.service == "pdserve-decode" and decode.parent_id == root.span_id
    assert prefill.service == "pdserve-prefill" and prefill.parent_id == root.span_id
    assert prefill.attributes["pdserve.kv_bytes"] > 0
    for child, parent in [
        ("admission", decode),
        ("kv_wait", decode),
        ("first_output", decode),
        ("queue", prefill),
        ("compute", prefill),
    ]:
        assert by_name[child].parent_id == parent.span_id, child
    # The decode node's phases follow one another, within the router's span.
    assert by_name["admission"].end_ns <= by_name["kv_wait"].end_ns <= decode.end_ns
    assert root.start_ns <= decode.start_ns and decode.end_ns <= root.end_ns + 10**9
