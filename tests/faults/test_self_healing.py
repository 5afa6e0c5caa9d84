"""Self-healing (issue 15), real processes on a real Redis: the supervisor that
`pdserve up` runs restarts what dies, and the router migrates a stream whose
decode node dies or stalls after its first token to the other decode node.

One cluster (1 prefill, 2 decode nodes) for the module, supervised by the
same ``Supervisor`` that ``pdserve up`` polls, on a thread. The test that
gives up on a node runs last: it leaves that node down.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from pdserve.launcher import LocalCluster
from pdserve.supervisor import Supervisor, SupervisorConfig
from tests.faults.harness import (
    Stream,
    assert_idle,
    component,
    request,
    run,
    spec,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.timeout(900)

STREAMS = 16
TOKENS = 200
BACK_WITHIN_S = 15.0
PROMPTS = [
    "Tell me a long story about a dragon who learns to bake bread.",
    "Explain how a steam engine works, step by step.",
    "Write a letter to a friend describing your summer holidays.",
    "Describe the water cycle to a ten year old child.",
]


class Supervised:
    """The cluster and its supervisor, polled on a thread as `pdserve up` does."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.lines: list[str] = []
        config = SupervisorConfig(backoff_s=0.5, max_backoff_s=2.0, max_crashes=2, window_s=60)
        self.supervisor = Supervisor(cluster, config, say=self.lines.append)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.supervisor.poll()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def healing(demo_model_dir, tmp_path_factory):
    s = spec(demo_model_dir, tmp_path_factory.mktemp("healing-logs"), num_prefill=1, num_decode=2)
    with LocalCluster(s) as cluster:
        supervised = Supervised(cluster)
        try:
            yield supervised
        finally:
            supervised.stop()


def streams(cluster, sampling, tag: str) -> list[Stream]:
    """``sampling(i)``: stream i's sampling parameters; ``tag`` makes the prompts
    new to every node's prefix cache (which would draw them all to one node)."""
    return [
        Stream(
            cluster.router_address,
            request(
                PROMPTS[i % len(PROMPTS)] + f" ({tag} {i})",
                max_tokens=TOKENS,
                ignore_eos=True,
                **sampling(i),
            ),
        )
        for i in range(STREAMS)
    ]


def pdctl_nodes(cluster) -> list[str]:
    cli = [sys.executable, "-m", "router.pdctl", "--address", cluster.admin_address, "--json"]
    out = subprocess.run([*cli, "nodes"], capture_output=True, text=True, timeout=60)
    return sorted(n["node_id"] for n in json.loads(out.stdout)) if out.returncode == 0 else []


def migrations(cluster) -> dict[str, float]:
    """The router's pdserve_router_migrations_total, by outcome."""
    with urllib.request.urlopen(component(cluster, "router").metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_migrations_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def kill_mid_stream(healing: Supervised, sampling, tag: str):
    """The streams once undisturbed, then again with decode-0 killed mid-way."""
    cluster = healing.cluster
    reference = [s.result() for s in streams(cluster, sampling, tag)]
    assert all(o.code is grpc.StatusCode.OK for o in reference), [o.details for o in reference]
    running = streams(cluster, sampling, tag)
    # Every stream under way, with tokens at its client: a migration, not a retry.
    wait_for(lambda: all(len(s.outcome.token_ids) >= 20 for s in running), 300, "20 tokens each")
    victim = component(cluster, "decode-0")
    killed_at = time.monotonic()
    before = migrations(cluster).get("completed", 0)
    victim.process.send_signal(signal.SIGKILL)
    outcomes = [s.result() for s in running]
    # Streams were on decode-0, and moved (not a vacuous pass).
    assert migrations(cluster)["completed"] > before
    return reference, outcomes, killed_at


def check_migrated(reference, outcomes) -> None:
    for i, (ref, got) in enumerate(zip(reference, outcomes, strict=True)):
        assert got.code is grpc.StatusCode.OK, f"stream {i}: {got.code} {got.details}"
        assert got.token_ids == ref.token_ids, f"stream {i} differs from the undisturbed run"
        assert got.text == ref.text, f"stream {i}'s text differs"
        assert got.final.usage.completion_tokens == TOKENS
        assert got.final.usage.prompt_tokens == ref.final.usage.prompt_tokens


def test_generate_reads_the_prompt_from_stdin(healing):
    cli = [sys.executable, "-m", "pdserve.cli", "generate", "-", "--max-tokens", "4"]
    prompt = "Please summarise the following. " + "The quick brown fox jumps. " * 60
    out = subprocess.run(
        [*cli, "--address", healing.cluster.router_address],
        input=prompt,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    used = int(out.stderr.split("[", 1)[1].split(" prompt", 1)[0])
    assert used > 300  # the whole long prompt, not the "-"


def test_greedy_streams_survive_a_decode_node_sigkill(healing):
    cluster = healing.cluster
    reference, outcomes, killed_at = kill_mid_stream(
        healing, lambda i: {"temperature": 0.0}, "greedy"
    )
    check_migrated(reference, outcomes)
    wait_for(
        lambda: "decode-0" in pdctl_nodes(cluster),
        BACK_WITHIN_S - (time.monotonic() - killed_at),
        "decode-0 back in pdctl nodes",
        interval_s=0.5,
    )
    assert any(line.startswith("pdserve: decode-0 exited with code -9") for line in healing.lines)
    assert_idle(cluster, expect_nodes=3)


def test_seeded_streams_continue_exactly_after_a_decode_node_sigkill(healing):
    cluster = healing.cluster
    wait_for(lambda: "decode-0" in pdctl_nodes(cluster), 120, "decode-0 back", interval_s=0.5)
    reference, outcomes, _ = kill_mid_stream(
        healing, lambda i: {"temperature": 0.8, "seed": 1000 + i}, "seeded"
    )
    check_migrated(reference, outcomes)
    wait_for(lambda: "decode-0" in pdctl_nodes(cluster), 120, "decode-0 back", interval_s=0.5)
    assert_idle(cluster, expect_nodes=3)


def test_32_streams_all_complete_and_the_seam_costs_one_prefill(healing):
    """The issue's target, measured: SIGKILL under 32 streams; the added latency
    of a migrated stream is its longest silence after the kill, bounded by the
    slowest first token of the undisturbed run (a prefill of a prompt as long,
    under the same load) plus 1 s."""
    cluster = healing.cluster
    wait_for(lambda: "decode-0" in pdctl_nodes(cluster), 120, "decode-0 back", interval_s=0.5)
    wait_idle(cluster, 30, expect_nodes=3)
    time.sleep(6)  # past the router's failure cool-down for decode-0: streams on both

    def start():
        return [
            Stream(
                cluster.router_address,
                request(f"Stream {i}: count slowly.", max_tokens=64, ignore_eos=True),
            )
            for i in range(32)
        ]

    begun = time.monotonic()
    reference = [s.result() for s in start()]
    slowest_ttft = max(o.first_at for o in reference) - begun
    running = start()
    wait_for(lambda: all(len(s.outcome.token_ids) >= 10 for s in running), 300, "10 tokens")
    counts = [len(s.outcome.token_ids) for s in running]
    before = migrations(cluster).get("completed", 0)
    component(cluster, "decode-0").process.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    resumed: dict[int, float] = {}

    def all_moving():
        for i, s in enumerate(running):
            if i not in resumed and (len(s.outcome.token_ids) > counts[i] or s.done.is_set()):
                resumed[i] = time.monotonic() - killed
        return len(resumed) == len(running)

    wait_for(all_moving, 120, "every stream moving again", interval_s=0.01)
    outcomes = [s.result() for s in running]
    moved = migrations(cluster)["completed"] - before
    check = [(r, o) for r, o in zip(reference, outcomes, strict=True)]
    assert all(o.code is grpc.StatusCode.OK for _, o in check), [o.details for _, o in check]
    assert all(o.token_ids == r.token_ids and o.text == r.text for r, o in check)
    worst = max(resumed.values())
    print(
        f"32/32 streams complete, {moved:.0f} migrated; longest silence after the kill "
        f"{worst:.2f} s; slowest undisturbed first token {slowest_ttft:.2f} s"
    )
    assert moved >= 1
    assert worst <= slowest_ttft + 1.0


def test_a_stalled_decode_node_loses_its_streams_to_the_other(healing):
    cluster = healing.cluster
    wait_for(lambda: "decode-0" in pdctl_nodes(cluster), 120, "decode-0 back", interval_s=0.5)
    victim = component(cluster, "decode-0")
    running = [
        Stream(cluster.router_address, request(f"{p} (stall {i})", max_tokens=60, ignore_eos=True))
        for i, p in enumerate(PROMPTS * 2)
    ]
    before = migrations(cluster).get("completed", 0)
    wait_for(lambda: all(len(s.outcome.token_ids) >= 5 for s in running), 300, "5 tokens each")
    victim.process.send_signal(signal.SIGSTOP)
    try:
        outcomes = [s.result() for s in running]
    finally:
        victim.process.send_signal(signal.SIGCONT)
    for o in outcomes:
        assert o.code is grpc.StatusCode.OK, o.details
        assert len(o.token_ids) == 60
    assert migrations(cluster)["completed"] > before
    assert_idle(cluster, expect_nodes=3)


def test_redis_sigkill_is_restarted_and_requests_keep_succeeding(healing):
    cluster = healing.cluster
    before = healing.supervisor.restarts()["redis"]
    cluster.redis.process.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 8
    codes = []
    while time.monotonic() < deadline:  # during the outage and after
        codes.append(run(cluster.router_address, request("Hello there", max_tokens=4)).code)
    wait_for(lambda: healing.supervisor.restarts()["redis"] == before + 1, 30, "redis restarted")
    wait_for(lambda: len(pdctl_nodes(cluster)) == 3, 30, "nodes re-registered", interval_s=0.5)
    codes.append(run(cluster.router_address, request("Hello again", max_tokens=4)).code)
    assert codes and all(c is grpc.StatusCode.OK for c in codes), codes


def test_a_node_crashing_at_start_is_given_up_on_and_the_rest_serve(healing):
    cluster = healing.cluster
    # Every restart of prefill-0 now fails at start-up (a bad fault spec).
    cluster.spec.component_env["prefill-0"] = {"PDSERVE_FAULT_DELAYS": "no_such_point=1"}
    component(cluster, "prefill-0").process.send_signal(signal.SIGKILL)
    wait_for(lambda: "prefill-0" in healing.supervisor.given_up, 120, "gave up on prefill-0")
    given_up = [line for line in healing.lines if line.startswith("pdserve: giving up on")]
    assert len(given_up) == 1 and "prefill-0" in given_up[0] and "prefill-0.log" in given_up[0]
    assert healing.supervisor.restarts()["prefill-0"] == 2
    for p in PROMPTS:
        assert run(cluster.router_address, request(p, max_tokens=8)).code is grpc.StatusCode.OK
