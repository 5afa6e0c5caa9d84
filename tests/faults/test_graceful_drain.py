"""Graceful drain on SIGTERM (real processes, a real Redis): the node says
NOT_SERVING at once, routers stop choosing it, the requests it has finish, and
it exits 0 within its drain timeout."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.grpc_server import health_check
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc
from proto.client import generate
from tests.faults.harness import assert_idle

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    spec = ClusterSpec(
        model=str(demo_model_dir),
        num_prefill=0,
        num_decode=2,
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", "1024"],
        node_args=["--heartbeat-interval", "0.2", "--drain-timeout", "60"],
        log_dir=str(tmp_path_factory.mktemp("drain-logs")),
        start_timeout_s=300,
    )
    with LocalCluster(spec) as c:
        yield c


def nodes(cluster) -> dict[str, admin_pb2.NodeInfo]:
    with grpc.insecure_channel(cluster.admin_address) as ch:
        listed = admin_pb2_grpc.AdminStub(ch).ListNodes(admin_pb2.ListNodesRequest(), timeout=10)
    return {n.node_id: n for n in listed.nodes}


def test_sigterm_lets_in_flight_requests_finish_and_exits_zero(cluster):
    stream = generate(
        cluster.router_address,
        "Tell me a long story.",
        max_tokens=150,
        ignore_eos=True,
        timeout=300,
    )
    first = next(stream)
    deadline = time.monotonic() + 5
    while not (busy := [n for n in nodes(cluster).values() if n.running > 0]):
        assert time.monotonic() < deadline, "no node reports the stream running"
        time.sleep(0.1)  # the next heartbeat publishes it
    assert len(busy) == 1
    victim = busy[0].node_id
    proc = next(c for c in cluster.components if c.name == victim)
    pool = ThreadPoolExecutor(1)
    rest = pool.submit(lambda: list(stream))

    proc.process.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while health_check(proc.address, timeout=0.5):  # NOT_SERVING at once
        assert time.monotonic() - t0 < 2, "still SERVING 2 s after SIGTERM"
        time.sleep(0.05)
    deadline = time.monotonic() + 3
    while not nodes(cluster)[victim].draining:
        assert time.monotonic() < deadline, "draining not published"
        time.sleep(0.1)
    # No new work for it: every new request goes to the other node.
    for i in range(4):
        final = None
        for r in generate(cluster.router_address, f"Question {i}?", max_tokens=2, timeout=120):
            if r.HasField("final"):
                final = r.final
        assert final.usage.decode_node != victim
    # The stream it had finishes normally...
    responses = [first, *rest.result(timeout=300)]
    pool.shutdown()
    final = responses[-1].final
    assert final.usage.decode_node == victim and final.usage.completion_tokens == 150
    # ...and then it exits 0, well within its 60 s drain timeout, and leaves Redis.
    assert proc.process.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 60
    deadline = time.monotonic() + 5
    while victim in nodes(cluster):
        assert time.monotonic() < deadline, "still registered after exiting"
        time.sleep(0.1)
    assert_idle(cluster, expect_nodes=1)  # the other node owes nothing, leaks nothing


def test_a_second_signal_cuts_the_drain_short(cluster):
    alive = [
        c for c in cluster.components if c.name.startswith("decode") and c.process.poll() is None
    ]
    assert len(alive) == 1  # the previous test stopped the other one
    survivor = alive[0]
    stream = generate(
        cluster.router_address, "Another long story.", max_tokens=600, ignore_eos=True, timeout=300
    )
    next(stream)
    pool = ThreadPoolExecutor(1)
    rest = pool.submit(lambda: list(stream))  # the client keeps reading
    survivor.process.send_signal(signal.SIGTERM)
    time.sleep(2.0)
    assert survivor.process.poll() is None  # draining: the request is still running
    survivor.process.send_signal(signal.SIGTERM)
    assert survivor.process.wait(timeout=30) == 0
    with pytest.raises(grpc.RpcError) as info:
        rest.result(timeout=60)
    pool.shutdown()
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
