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

import grpc
import pytest

from pdserve.launcher import LocalCluster
from pdserve.supervisor import Supervisor, SupervisorConfig
from tests.faults.harness import Stream, assert_idle, component, request, run, spec, wait_for

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


def streams(cluster, sampling) -> list[Stream]:
    """``sampling(i)``: stream i's sampling parameters."""
    return [
        Stream(
            cluster.router_address,
            request(
                PROMPTS[i % len(PROMPTS)] + f" (version {i})",
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


def kill_mid_stream(healing: Supervised, sampling, victim_signal=signal.SIGKILL):
    """The streams once undisturbed, then again with decode-0 killed mid-way."""
    cluster = healing.cluster
    reference = [s.result() for s in streams(cluster, sampling)]
    assert all(o.code is grpc.StatusCode.OK for o in reference), [o.details for o in reference]
    running = streams(cluster, sampling)
    # Every stream under way, with tokens at its client: a migration, not a retry.
    wait_for(lambda: all(len(s.outcome.token_ids) >= 20 for s in running), 300, "20 tokens each")
    victim = component(cluster, "decode-0")
    killed_at = time.monotonic()
    victim.process.send_signal(victim_signal)
    outcomes = [s.result() for s in running]
    return reference, outcomes, killed_at


def check_migrated(healing: Supervised, reference, outcomes) -> None:
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
    reference, outcomes, killed_at = kill_mid_stream(healing, lambda i: {"temperature": 0.0})
    check_migrated(healing, reference, outcomes)
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
        healing, lambda i: {"temperature": 0.8, "seed": 1000 + i}
    )
    check_migrated(healing, reference, outcomes)
    wait_for(lambda: "decode-0" in pdctl_nodes(cluster), 120, "decode-0 back", interval_s=0.5)
    assert_idle(cluster, expect_nodes=3)


def test_a_stalled_decode_node_loses_its_streams_to_the_other(healing):
    cluster = healing.cluster
    wait_for(lambda: "decode-0" in pdctl_nodes(cluster), 120, "decode-0 back", interval_s=0.5)
    victim = component(cluster, "decode-0")
    running = [
        Stream(cluster.router_address, request(p, max_tokens=60, ignore_eos=True))
        for p in PROMPTS * 2
    ]
    wait_for(lambda: all(len(s.outcome.token_ids) >= 5 for s in running), 300, "5 tokens each")
    victim.process.send_signal(signal.SIGSTOP)
    try:
        outcomes = [s.result() for s in running]
    finally:
        victim.process.send_signal(signal.SIGCONT)
    for o in outcomes:
        assert o.code is grpc.StatusCode.OK, o.details
        assert len(o.token_ids) == 60
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
