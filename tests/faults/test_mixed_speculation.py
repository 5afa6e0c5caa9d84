"""A mixed cluster (issue "speculative decoding on the decode nodes"): one
decode node speculates (n-gram), the other does not, in one cluster of real
processes on a real Redis, KV over gloo.

decode-0 gets its speculative config from its own environment
(PDSERVE_SPECULATIVE_CONFIG, the flag's variable; `pdserve up
--speculative-config` sets every decode node alike); decode-1 runs plain.
Every request is prefilled on prefill-0 (the router's local-prefill
thresholds are off). Greedy and seeded requests give the text of a plain
in-process engine on either decode node; only decode-0's counters show
proposals. A stream moved by a SIGKILL from the speculating node to the
plain one, and back the other way, completes as the plain engine's.
One cluster for the module; few tokens (CI: 2 cores).
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request

import grpc
import pytest

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


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("mixed-spec-logs"),
        num_prefill=1,
        num_decode=2,
        router_args=REMOTE_PREFILL_ONLY,
        component_env={SPECULATING: {"PDSERVE_SPECULATIVE_CONFIG": json.dumps(SPEC)}},
    )
    with LocalCluster(s) as c:
        yield c


@pytest.fixture(scope="module")
def plain_engine(demo_model_dir):
    """The reference: one plain engine in this process, no cluster, no speculation."""
    return LLM(str(demo_model_dir), max_model_len=1024, device="cpu", num_kvcache_blocks=64)


def kinds(tokens: int) -> list[tuple[str, dict]]:
    """(prompt, sampling) of a greedy and a seeded request per prompt."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append((prompt, {"temperature": 0.0, "max_tokens": tokens}))
        out.append((prompt, {"temperature": 0.8, "seed": 7 + i, "max_tokens": tokens}))
    return out


def reference(engine: LLM, prompt: str, sampling: dict):
    params = SamplingParams(ignore_eos=True, **sampling)
    (out,) = engine.generate([prompt], params, use_tqdm=False)
    return out.outputs[0]


def spec_counter(c: LocalCluster, node: str, kind: str) -> float | None:
    """A decode node's pdserve_spec_decode_num_{kind}_tokens_total (None: the
    node exports no such family, as a node without speculation)."""
    with urllib.request.urlopen(component(c, node).metrics_url, timeout=10) as r:
        text = r.read().decode()
    found = re.findall(
        rf"^pdserve_spec_decode_num_{kind}_tokens_total{{[^}}]*}} (\S+)$", text, re.MULTILINE
    )
    return float(found[0]) if found else None


def only_on(c: LocalCluster, node: str):
    """Drain the other decode node while the block runs: the router picks ``node``."""
    other = PLAIN if node == SPECULATING else SPECULATING
    set_drained(c, other, True)
    return other


def check_same(got: Outcome, want, node: str | None = None) -> None:
    assert got.code is grpc.StatusCode.OK, (got.code, got.details)
    assert got.token_ids == list(want.token_ids)
    assert got.text == want.text
    if node is not None:
        assert got.final.usage.decode_node == node
        assert got.final.usage.prefill_node == "prefill-0"  # disaggregated


def test_both_decode_nodes_give_the_plain_engines_text(cluster, plain_engine):
    requests = kinds(TOKENS)
    want = [reference(plain_engine, p, s) for p, s in requests]
    for node in (SPECULATING, PLAIN):
        other = only_on(cluster, node)
        try:
            streams = [
                Stream(cluster.router_address, request(p, ignore_eos=True, **s))
                for p, s in requests
            ]
            for stream, ref in zip(streams, want, strict=True):
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


def move(cluster: LocalCluster, plain_engine: LLM, victim: str) -> tuple:
    """Start a greedy and a seeded stream on ``victim``, SIGKILL it once both
    have tokens at their client, and check they complete on the other decode
    node as the plain engine's (a migration: the router's counter moves).
    The victim's accepted-token counter before the streams and at the kill."""
    requests = kinds(MOVED_TOKENS)[:2]  # greedy and seeded, the first prompt
    want = [reference(plain_engine, p, s) for p, s in requests]
    router = component(cluster, "router").metrics_url
    before = migrations_completed(router)
    kept = [spec_counter(cluster, victim, "accepted")]
    other = only_on(cluster, victim)
    try:
        streams = [
            Stream(cluster.router_address, request(p, ignore_eos=True, **s)) for p, s in requests
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
    for stream, ref in zip(streams, want, strict=True):
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


def test_a_stream_moves_exactly_from_the_speculating_node_to_the_plain_one(
    cluster, plain_engine
):
    before, at_kill = move(cluster, plain_engine, SPECULATING)
    assert at_kill > before  # the streams speculated before the kill
    assert spec_counter(cluster, PLAIN, "draft") is None
    rejoin(cluster, SPECULATING)
    # The restarted node speculates again (its environment is the same).
    assert spec_counter(cluster, SPECULATING, "draft") is not None


def test_a_stream_moves_exactly_from_the_plain_node_to_the_speculating_one(
    cluster, plain_engine
):
    kept = spec_counter(cluster, SPECULATING, "accepted")
    move(cluster, plain_engine, PLAIN)
    # The continuation speculated on decode-0.
    assert spec_counter(cluster, SPECULATING, "accepted") > kept
    rejoin(cluster, PLAIN)
    assert_idle(cluster)
