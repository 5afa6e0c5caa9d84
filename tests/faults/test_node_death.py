"""Node death and stalls (real processes, a real Redis, KV over gloo):
SIGKILL a decode node under 16 streams, SIGKILL a prefill node in the middle
of its KV stream, SIGSTOP either kind, restart the dead ones.

Every request here is prefilled remotely (the router's local-prefill
thresholds are off), so every one crosses the prefill -> decode hand-off.
The router runs with --no-migration: a stream whose decode node dies fails
(test_self_healing.py covers migration). prefill-0 holds each request's last group of KV segments half-way (one
chunk out) for TRANSFER_PAUSE_S seconds: a window in which to kill it with a
stream on the wire.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from common.cluster.state import NodeRole
from pdserve.launcher import LocalCluster
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.faults.harness import (
    Stream,
    assert_idle,
    component,
    nodes,
    request,
    run,
    set_drained,
    spec,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)

TRANSFER_PAUSE_S = 2.0
LEASE_S = 5.0
STREAMS = 16
TOKENS = 64  # each; the first streams are still running when the last gets its first token
UNAVAILABLE_WITHIN_S = 5.0
TTL_S = 3.0  # nodes' heartbeat TTL in this cluster


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("death-logs"),
        num_prefill=2,
        num_decode=2,
        node_args=["--node-ttl", str(TTL_S)],
        # Streams fail with their decode node here (the off-switch's behaviour);
        # tests/faults/test_self_healing.py has them migrate instead.
        router_args=[*REMOTE_PREFILL_ONLY, "--no-migration"],
        component_env={
            "prefill-0": {"PDSERVE_FAULT_DELAYS": f"transfer_mid={TRANSFER_PAUSE_S}"},
            "decode-0": {"PDSERVE_KV_LEASE_S": str(LEASE_S)},
            "decode-1": {"PDSERVE_KV_LEASE_S": str(LEASE_S)},
        },
    )
    with LocalCluster(s) as c:
        yield c


def rejoins(cluster, victim, other: str, req, role_field: str):
    """Restart ``victim``; with ``other`` drained, a request must be served by it
    again within 60 s (its first ones may still meet a cool-down, and a restarted
    prefill-0 still pauses every transfer mid-way: on a loaded 2-core host 30 s
    was once not enough)."""
    cluster.restart(victim)
    wait_for(lambda: victim.name in nodes(cluster), 10, "restarted node registered")
    set_drained(cluster, other, True)
    try:

        def served():
            o = run(cluster.router_address, req)
            ok = o.code is grpc.StatusCode.OK
            return o if ok and getattr(o.final.usage, role_field) == victim.name else None

        return wait_for(served, 60, f"a request served by the restarted {victim.name}", 1.0)
    finally:
        set_drained(cluster, other, False)


def test_sigkill_decode_mid_stream_fails_only_its_streams_fast(cluster):
    # prefill-1 only: prefill-0's held transfers would stagger the first tokens
    # over seconds, and early streams could finish before the kill.
    set_drained(cluster, "prefill-0", True)
    try:
        kill_decode_under_load(cluster)
    finally:
        set_drained(cluster, "prefill-0", False)
    assert_idle(cluster, expect_nodes=4)


def kill_decode_under_load(cluster):
    streams = [
        Stream(
            cluster.router_address,
            request(f"Stream {i}: count slowly.", max_tokens=TOKENS, ignore_eos=True),
        )
        for i in range(STREAMS)
    ]
    for s in streams:
        assert s.first.wait(120), "a stream got no first token"
    victim = component(cluster, "decode-0")
    victim.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    outcomes = [s.result(120) for s in streams]
    failed = [o for o in outcomes if o.code is not grpc.StatusCode.OK]
    ok = [o for o in outcomes if o.code is grpc.StatusCode.OK]
    assert failed and ok, f"the {STREAMS} streams should have been spread over both decode nodes"
    for o in failed:
        assert o.code is grpc.StatusCode.UNAVAILABLE, (o.code, o.details)
        assert o.ended_at - killed <= UNAVAILABLE_WITHIN_S
    for o in ok:  # the others are unaffected
        assert len(o.token_ids) == TOKENS
        assert o.final.usage.decode_node == "decode-1"
    worst = max(o.ended_at - killed for o in failed)
    print(f"{len(failed)} streams on the killed node: UNAVAILABLE within {worst:.2f} s")

    # The router stops choosing it at once (its calls failed), before the TTL.
    for i in range(4):
        o = run(cluster.router_address, request(f"After the kill {i}.", max_tokens=2))
        assert o.code is grpc.StatusCode.OK, o.details
        assert o.final.usage.decode_node == "decode-1"
    wait_for(lambda: "decode-0" not in nodes(cluster), TTL_S + 2, "dead node left Redis")

    # Restarted, it rejoins and serves again (remote prefill into a new process).
    o = rejoins(cluster, victim, "decode-1", request("Back?", max_tokens=3), "decode_node")
    assert o.final.usage.prefill_node == "prefill-1"


def landed_bytes(cluster) -> int:
    return sum(n.kv_transfer_bytes for n in nodes(cluster).values() if n.role is NodeRole.DECODE)


def test_sigkill_prefill_mid_stream_retries_on_the_other_prefill_node(cluster):
    prompt = "Tell me about the history of the printing press."
    expected = run(cluster.router_address, request(prompt, max_tokens=12)).token_ids
    set_drained(cluster, "prefill-1", True)  # the request must start on prefill-0
    landed_before = landed_bytes(cluster)
    stream = Stream(cluster.router_address, request(prompt, max_tokens=12))
    # Killed mid-stream: its first chunk landed, the rest of its group waits.
    wait_for(lambda: landed_bytes(cluster) > landed_before, 30, "a first chunk landed", 0.02)
    set_drained(cluster, "prefill-1", False)
    victim = component(cluster, "prefill-0")
    victim.process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    outcome = stream.result(60)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.final.usage.prefill_node == "prefill-1"  # retried there
    assert outcome.token_ids == expected
    assert outcome.first_at - killed < 5
    # The decode node's reservation for the dead transfer is gone too.
    wait_for(lambda: "prefill-0" not in nodes(cluster), TTL_S + 2, "dead node left Redis")
    assert_idle(cluster, expect_nodes=3)

    o = rejoins(cluster, victim, "prefill-1", request(prompt, max_tokens=12), "prefill_node")
    assert o.token_ids == expected
    assert_idle(cluster, expect_nodes=4)


def test_a_stalled_prefill_node_costs_one_lease_then_the_request_is_served(cluster):
    set_drained(cluster, "prefill-0", True)  # the request goes to prefill-1, which stalls
    stalled = component(cluster, "prefill-1")
    stalled.process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        o = run(cluster.router_address, request("Are you there?", max_tokens=4), timeout=60)
        elapsed = time.monotonic() - start
    finally:
        stalled.process.send_signal(signal.SIGCONT)
        set_drained(cluster, "prefill-0", False)
    assert o.code is grpc.StatusCode.OK, o.details
    # Retried where it could be: prefill-0 is drained, so on the decode node itself.
    assert o.final.usage.prefill_node == ""
    assert elapsed < LEASE_S + 3, f"served only after {elapsed:.1f} s"
    print(f"stalled prefill node: served after {elapsed:.2f} s (lease {LEASE_S} s)")
    assert_idle(cluster, expect_nodes=4)


def test_a_stalled_decode_node_fails_its_stream_within_the_keepalive(cluster):
    set_drained(cluster, "decode-1", True)
    try:
        stream = Stream(
            cluster.router_address,
            request("Write a long poem.", max_tokens=300, ignore_eos=True),
        )
        assert stream.first.wait(60)
    finally:
        set_drained(cluster, "decode-1", False)
    stalled = component(cluster, "decode-0")
    stalled.process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        outcome = stream.result(60)
    finally:
        stalled.process.send_signal(signal.SIGCONT)
    took = outcome.ended_at - stopped
    assert outcome.code is grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
    assert took < 10, f"UNAVAILABLE only after {took:.1f} s"
    print(f"stalled decode node: stream failed {took:.2f} s after SIGSTOP")
    # Resumed, it finds the stream cancelled and frees everything.
    assert_idle(cluster, expect_nodes=4)
