"""A mixed cluster (issue "speculative decoding on the decode nodes"): one
decode node speculates (n-gram), the other does not, in one cluster of real
processes on a real Redis, KV over gloo.

decode-0 gets its speculative config from its own environment
(PDSERVE_SPECULATIVE_CONFIG, the flag's variable; `pdserve up
--speculative-config` sets every decode node alike); decode-1 runs plain.
Every request is prefilled on prefill-0 (the router's local-prefill
thresholds are off). Greedy and seeded requests give the text of a plain
in-process engine on either decode node; only decode-0's counters show
proposals. A stream moved by a SIGKILL from the plain node to the
speculating one (the plain node then restarted), and from the speculating
node to the plain one, completes as the plain engine's. One cluster for the
module, tests in order; few tokens (CI: 2 cores).
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request

import grpc
import pytest
import torch

from engine import LLM, SamplingParams
from pdserve.launcher import LocalCluster
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.faults.harness import (
    Outcome,
    Stream,
    assert_idle,
    component,
    counters,
    nodes,
    request,
    run,
    set_drained,
    spec,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
SPECULATING, PLAIN = "decode-0", "decode-1"
# Text that repeats itself: prompt lookup finds its continuation.
PROMPTS = [
    "one two three four five six seven eight nine ten one two three four five six",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
]
TOKENS = 16
MOVED_TOKENS = 40  # a moved stream's; the kill comes after KILL_AFTER of them
KILL_AFTER = 6
TTL_S = 3.0  # nodes' heartbeat TTL: the last test's victim leaves Redis soon


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("mixed-spec-logs"),
        num_prefill=1,
        num_decode=2,
        node_args=["--node-ttl", str(TTL_S)],
        router_args=REMOTE_PREFILL_ONLY,
        component_env={SPECULATING: {"PDSERVE_SPECULATIVE_CONFIG": json.dumps(SPEC)}},
    )
    with LocalCluster(s) as c:
        yield c


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The cluster's processes hold the cores: the reference engine in this
    process is several times faster on one thread than on two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def kinds(tokens: int) -> list[tuple[str, dict]]:
    """(prompt, sampling) of a greedy and a seeded request per prompt."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append((prompt, {"temperature": 0.0, "max_tokens": tokens}))
        out.append((prompt, {"temperature": 0.8, "seed": 7 + i, "max_tokens": tokens}))
    return out


REQUESTS = kinds(TOKENS)
MOVED = kinds(MOVED_TOKENS)[:2]  # greedy and seeded, the first prompt


@pytest.fixture(scope="module")
def want(demo_model_dir):
    """The reference for REQUESTS + MOVED: one plain engine in this process,
    no cluster, no speculation, one batch."""
    engine = LLM(str(demo_model_dir), max_model_len=1024, device="cpu", num_kvcache_blocks=64)
    every = REQUESTS + MOVED
    params = [SamplingParams(ignore_eos=True, **s) for _, s in every]
    outs = engine.generate([p for p, _ in every], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def spec_counter(c: LocalCluster, node: str, kind: str) -> float | None:
    """A decode node's pdserve_spec_decode_num_{kind}_tokens_total (None: the
    node exports no such family, as a node without speculation)."""
    with urllib.request.urlopen(component(c, node).metrics_url, timeout=10) as r:
        text = r.read().decode()
    found = re.findall(
        rf"^pdserve_spec_decode_num_{kind}_tokens_total{{[^}}]*}} (\S+)$", text, re.MULTILINE
    )
    return float(found[0]) if found else None


def other_of(node: str) -> str:
    return PLAIN if node == SPECULATING else SPECULATING


def only_on(c: LocalCluster, node: str) -> str:
    """Drain the other decode node (the caller undrains it): the router picks ``node``."""
    other = other_of(node)
    set_drained(c, other, True)
    return other


def check_same(got: Outcome, want, node: str | None = None) -> None:
    assert got.code is grpc.StatusCode.OK, (got.code, got.details)
    assert got.token_ids == list(want.token_ids)
    assert got.text == want.text
    if node is not None:
        assert got.final.usage.decode_node == node
        assert got.final.usage.prefill_node == "prefill-0"  # disaggregated


def test_both_decode_nodes_give_the_plain_engines_text(cluster, want):
    for node in (SPECULATING, PLAIN):
        other = only_on(cluster, node)
        try:
            streams = [
                Stream(cluster.router_address, request(p, ignore_eos=True, **s))
                for p, s in REQUESTS
            ]
            for stream, ref in zip(streams, want[: len(REQUESTS)], strict=True):
                check_same(stream.result(120), ref, node)
        finally:
            set_drained(cluster, other, False)
    assert spec_counter(cluster, SPECULATING, "accepted") > 0  # it speculated, and it paid
    assert spec_counter(cluster, PLAIN, "draft") is None  # it never proposed
    # What the heartbeats publish (pdctl stats) says the same.
    wait_for(
        lambda: counters(cluster, "spec_accepted_tokens")[SPECULATING]["spec_accepted_tokens"],
        10,
        "decode-0's accepted tokens published",
    )
    published = counters(cluster, "spec_draft_tokens", "spec_accepted_tokens")
    assert published[PLAIN] == {"spec_draft_tokens": 0, "spec_accepted_tokens": 0}
    assert_idle(cluster, expect_nodes=3)


def move(cluster: LocalCluster, want: list, victim: str) -> tuple:
    """Start a greedy and a seeded stream on ``victim``, SIGKILL it once both
    have tokens at their client, and check they complete on the other decode
    node as the plain engine's (a migration: the router's counter moves).
    The victim's accepted-token counter before the streams and at the kill."""
    other = other_of(victim)
    if component(cluster, other).process.poll() is not None:
        pytest.fail(f"{other} is down (an earlier test of this module failed before its restart)")
    router = component(cluster, "router").metrics_url
    before = migrations_completed(router)
    kept = [spec_counter(cluster, victim, "accepted")]
    only_on(cluster, victim)
    try:
        streams = [
            Stream(cluster.router_address, request(p, ignore_eos=True, **s)) for p, s in MOVED
        ]
        wait_for(
            lambda: all(len(s.outcome.token_ids) >= KILL_AFTER for s in streams),
            120,
            f"{KILL_AFTER} tokens each",
            interval_s=0.01,
        )
        kept.append(spec_counter(cluster, victim, "accepted"))
        process = component(cluster, victim).process
        process.send_signal(signal.SIGSTOP)  # no token more; checked, then killed
        assert not any(s.done.is_set() for s in streams), "a stream ended before the kill"
    finally:
        set_drained(cluster, other, False)
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    for stream, ref in zip(streams, want[len(REQUESTS) :], strict=True):
        got = stream.result(120)
        check_same(got, ref)
        assert got.final.usage.decode_node == other
    assert migrations_completed(router) - before == len(streams)
    return tuple(kept)


def migrations_completed(url: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    found = re.findall(
        r'^pdserve_router_migrations_total{outcome="completed"} (\S+)$', text, re.MULTILINE
    )
    return float(found[0]) if found else 0.0


def rejoin(cluster: LocalCluster, name: str) -> None:
    """Restart a killed node; it serves a request routed to it again."""
    cluster.restart(component(cluster, name))
    wait_for(lambda: name in nodes(cluster), 30, f"{name} registered")
    other = only_on(cluster, name)
    try:

        def served():
            o = run(cluster.router_address, request("Hello again.", max_tokens=2))
            return o.code is grpc.StatusCode.OK and o.final.usage.decode_node == name

        wait_for(served, 60, f"a request served by the restarted {name}", interval_s=1.0)
    finally:
        set_drained(cluster, other, False)


def test_a_stream_moves_exactly_from_the_plain_node_to_the_speculating_one(cluster, want):
    kept = spec_counter(cluster, SPECULATING, "accepted")
    assert move(cluster, want, PLAIN) == (None, None)  # no proposals there
    # The continuation speculated on decode-0.
    assert spec_counter(cluster, SPECULATING, "accepted") > kept
    rejoin(cluster, PLAIN)
    assert spec_counter(cluster, PLAIN, "draft") is None  # restarted plain, as it was


def test_a_stream_moves_exactly_from_the_speculating_node_to_the_plain_one(cluster, want):
    before, at_kill = move(cluster, want, SPECULATING)
    assert at_kill > before  # the streams speculated before the kill
    assert spec_counter(cluster, PLAIN, "draft") is None
    # The victim leaves Redis with its heartbeat's TTL; the rest is idle.
    wait_for(lambda: SPECULATING not in nodes(cluster), 2 * TTL_S + 5, "decode-0 expired")
    assert_idle(cluster, expect_nodes=2)
