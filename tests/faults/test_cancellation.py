"""Cancellation and deadlines at every stage of a disaggregated request (real
processes, a real Redis, KV streamed over gloo).

The nodes hold each request for STAGE_S seconds at two hand-offs
(PDSERVE_FAULT_DELAYS): in the middle of the prefill node's last group of KV
segments (headers and one chunk out, the other chunks not), and on the decode
node after the KV landed, before the request joins the batch. A client that
cancels (or whose deadline passes) in the middle of a window therefore hits
that stage; a long prompt prefilled in small chunks is cancelled while it
computes, after some of its chunks landed. The nodes' per-stage abort
counters say which stage they saw, and every block on every node must be free
again within 1 s.
"""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.launcher import LocalCluster
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.faults.harness import (
    Stream,
    assert_idle,
    counters,
    nodes,
    request,
    spec,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.timeout(900)

STAGE_S = 3.0
# Each prefill engine step takes at least this long: a ~700-token prompt in
# 32-token chunks keeps the prefill engine busy for over 2 s on any machine.
STEP_S = 0.1
STAGES = ("queued", "prefill", "transfer", "admission", "decode")
FIELDS = tuple(f"aborted_{s}" for s in STAGES) + ("deadline_exceeded",)
FREED_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("cancel-logs"),
        num_prefill=1,
        num_decode=1,
        # Small prefill chunks: a long prompt keeps the prefill engine busy, so
        # a request sent behind it waits in the queue.
        engine_args=["--max-num-batched-tokens", "32", "--max-num-seqs", "16"],
        # Every prompt is prefilled remotely (the stages under test).
        router_args=REMOTE_PREFILL_ONLY,
        component_env={
            "prefill-0": {"PDSERVE_FAULT_DELAYS": f"transfer_mid={STAGE_S},prefill_step={STEP_S}"},
            "decode-0": {"PDSERVE_FAULT_DELAYS": f"decode_before_commit={STAGE_S}"},
        },
    )
    with LocalCluster(s) as c:
        yield c


@pytest.fixture(scope="module")
def overhead_s(cluster) -> float:
    """Seconds a request spends outside the injected windows before its first
    token (routing, queueing, computing; the KV channel is set up here too),
    so that cancellations land mid-window even on a slow, busy machine."""
    outcome = Stream(cluster.router_address, request("Warm up.", max_tokens=1)).result(120)
    assert outcome.code is grpc.StatusCode.OK
    ttft_s = outcome.final.usage.time_to_first_token_ms / 1e3
    assert ttft_s >= 2 * STAGE_S
    return ttft_s - 2 * STAGE_S


def deltas(before, after) -> dict[str, dict[str, int]]:
    out = {}
    for node, values in after.items():
        was = before.get(node, dict.fromkeys(values, 0))
        changed = {k: v - was[k] for k, v in values.items() if v != was[k]}
        if changed:
            out[node] = changed
    return out


def settled_deltas(cluster, before, expected, timeout_s: float = 3.0):
    """The counters' changes once they match ``expected`` (or after ``timeout_s``):
    a node that was already idle may publish its abort a heartbeat later."""
    deadline = time.monotonic() + timeout_s
    while (seen := deltas(before, counters(cluster, *FIELDS))) != expected:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return seen


def cancel_at(cluster, seconds: float, prompt: str, expected, **kwargs):
    before = counters(cluster, *FIELDS)
    stream = Stream(cluster.router_address, request(prompt, **kwargs))
    time.sleep(seconds)
    stream.cancel()
    cancelled = time.monotonic()
    outcome = stream.result(30)
    wait_idle(cluster, timeout_s=10)
    freed_s = time.monotonic() - cancelled
    return outcome, freed_s, settled_deltas(cluster, before, expected)


@pytest.mark.parametrize(
    ("at_s", "expected"),
    [
        # The prompt computed; its last group half-way on the wire.
        (
            0.5 * STAGE_S,
            {"prefill-0": {"aborted_transfer": 1}, "decode-0": {"aborted_prefill": 1}},
        ),
        # KV landed on the decode node, not yet admitted to its batch.
        (1.5 * STAGE_S, {"decode-0": {"aborted_admission": 1}}),
    ],
    ids=["mid-transfer", "before-decode-admission"],
)
def test_cancel_frees_every_block_within_a_second(cluster, overhead_s, at_s, expected):
    at_s += overhead_s
    outcome, freed_s, seen = cancel_at(
        cluster, at_s, f"Cancel me after {at_s:.1f} seconds.", expected
    )
    assert outcome.code is grpc.StatusCode.CANCELLED
    assert not outcome.token_ids
    assert seen == expected
    assert freed_s <= FREED_WITHIN_S, f"blocks freed only {freed_s:.2f} s after the cancel"
    print(f"cancelled at {at_s:.1f} s: {seen}; all blocks free {freed_s * 1e3:.0f} ms later")


def test_cancel_mid_stream_while_the_prompt_computes(cluster):
    # 32-token chunks of a ~700-token prompt, STEP_S each at least: its first
    # chunks land on the decode node while the rest is still computing.
    long_prompt = "Stream me: " + "a long prompt about rivers and the sea " * 70

    def landed() -> int:
        return counters(cluster, "kv_transfer_bytes")["decode-0"]["kv_transfer_bytes"]

    landed_before = landed()
    before = counters(cluster, *FIELDS)
    stream = Stream(cluster.router_address, request(long_prompt, max_tokens=4))
    wait_for(lambda: landed() > landed_before, 30, "a first chunk landed", 0.02)
    stream.cancel()
    cancelled = time.monotonic()
    outcome = stream.result(30)
    wait_idle(cluster, timeout_s=10)
    freed_s = time.monotonic() - cancelled
    assert outcome.code is grpc.StatusCode.CANCELLED
    expected = {"prefill-0": {"aborted_prefill": 1}, "decode-0": {"aborted_prefill": 1}}
    assert settled_deltas(cluster, before, expected) == expected
    assert freed_s <= FREED_WITHIN_S, f"blocks freed only {freed_s:.2f} s after the cancel"
    print(f"cancelled mid-stream: all blocks free {freed_s * 1e3:.0f} ms later")


def test_cancel_mid_decode(cluster):
    stream = Stream(
        cluster.router_address,
        request("Count from one to a thousand.", max_tokens=400, ignore_eos=True),
    )
    before = counters(cluster, *FIELDS)
    assert stream.first.wait(60) and stream.outcome.first_at is not None
    time.sleep(0.3)
    stream.cancel()
    cancelled = time.monotonic()
    outcome = stream.result(30)
    wait_idle(cluster, timeout_s=10)
    freed_s = time.monotonic() - cancelled
    assert outcome.code is grpc.StatusCode.CANCELLED
    assert 0 < len(outcome.token_ids) < 400
    expected = {"decode-0": {"aborted_decode": 1}}
    assert settled_deltas(cluster, before, expected) == expected
    assert freed_s <= FREED_WITHIN_S
    print(f"cancelled mid-decode: all blocks free {freed_s * 1e3:.0f} ms later")


def test_cancel_while_queued_behind_a_long_prompt(cluster):
    # 32-token chunks of a ~700-token prompt, STEP_S each at least, keep the
    # prefill engine busy; the request sent after it waits in the queue.
    long_prompt = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 70
    before = counters(cluster, *FIELDS)
    blocker = Stream(cluster.router_address, request(long_prompt, max_tokens=1))
    # Not a fixed pause: on a loaded host the blocker may reach the prefill
    # node late. It runs there first, then the request sent after it waits.
    wait_for(lambda: nodes(cluster)["prefill-0"].running >= 1, 30, "the blocker runs")
    queued = Stream(cluster.router_address, request("Am I queued?"))
    wait_for(lambda: nodes(cluster)["prefill-0"].waiting >= 1, 30, "the request waits")
    queued.cancel()
    assert queued.result(30).code is grpc.StatusCode.CANCELLED
    assert blocker.result(120).code is grpc.StatusCode.OK
    wait_idle(cluster, timeout_s=10)
    expected = {"prefill-0": {"aborted_queued": 1}, "decode-0": {"aborted_prefill": 1}}
    assert settled_deltas(cluster, before, expected) == expected


def test_deadline_mid_transfer_gives_deadline_exceeded_and_frees_everything(cluster, overhead_s):
    before = counters(cluster, *FIELDS)
    start = time.monotonic()
    timeout = overhead_s + 0.5 * STAGE_S
    outcome = Stream(
        cluster.router_address, request("My deadline passes mid-transfer."), timeout=timeout
    ).result(30)
    elapsed = time.monotonic() - start
    wait_idle(cluster, timeout_s=10)
    freed_s = time.monotonic() - start - timeout
    assert outcome.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed < timeout + 1.0
    # Both nodes saw the deadline pass (the prefill node's copy of it is the same instant).
    expected = {
        "decode-0": {"aborted_prefill": 1, "deadline_exceeded": 1},
        "prefill-0": {"aborted_transfer": 1, "deadline_exceeded": 1},
    }
    assert settled_deltas(cluster, before, expected) == expected
    assert freed_s <= FREED_WITHIN_S
    print(
        f"deadline {timeout:.1f} s: DEADLINE_EXCEEDED after {elapsed:.2f} s; "
        f"all blocks free {freed_s * 1e3:.0f} ms after the deadline"
    )


def test_a_request_left_alone_completes_and_the_cluster_ends_idle(cluster):
    outcome = Stream(
        cluster.router_address, request("Finish normally.", max_tokens=4, ignore_eos=True)
    ).result(60)
    assert outcome.code is grpc.StatusCode.OK
    assert len(outcome.token_ids) == 4
    assert outcome.final.usage.prefill_node == "prefill-0"
    assert_idle(cluster, expect_nodes=2)
