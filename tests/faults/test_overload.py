"""Overload: a burst of 10x what the cluster admits (real processes).

The decode node runs 4 sequences and queues 4 more (--max-num-seqs 4,
--max-queued-requests 4); the router relays at most 32 streams. A burst of 80
concurrent requests must get quick RESOURCE_EXHAUSTED answers for what does
not fit -- before any token -- while the admitted requests finish with their
usual per-token latency, no process dies and no process's memory keeps
growing from one burst to the next.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import grpc
import pytest

from pdserve.launcher import LocalCluster
from tests.faults.harness import Stream, assert_idle, component, request, spec

pytestmark = pytest.mark.timeout(900)

CAPACITY = 8  # 4 running + 4 queued on the decode node
BURST = 10 * CAPACITY
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("overload-logs"),
        num_prefill=1,
        num_decode=1,
        engine_args=["--max-num-seqs", "4"],
        node_args=["--max-queued-requests", "4"],
        router_args=["--max-in-flight", "32"],
    )
    with LocalCluster(s) as c:
        yield c


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def tpot_ms(outcome) -> float:
    u = outcome.final.usage
    return (outcome.ended_at - outcome.first_at) * 1e3 / max(1, u.completion_tokens - 1)


def burst(cluster, n: int, tag: str):
    start = time.monotonic()
    streams = [
        Stream(
            cluster.router_address,
            request(f"{tag} request {i}: tell me a fact.", max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        for i in range(n)
    ]
    return start, [s.result(300) for s in streams]


def test_a_10x_burst_is_refused_quickly_and_the_admitted_keep_their_latency(cluster):
    procs = {c.name: c.process for c in cluster.components}
    # Baseline: as many requests as run at once, no burst.
    _, base = burst(cluster, 4, "baseline")
    assert all(o.code is grpc.StatusCode.OK for o in base)
    base_tpot = statistics.median(tpot_ms(o) for o in base)
    _, warm = burst(cluster, CAPACITY, "warm-up")  # the largest batch shapes, once
    assert all(o.code is grpc.StatusCode.OK for o in warm)
    rss_before = {name: rss_mib(p.pid) for name, p in procs.items()}

    rss_after = []
    for round_ in range(2):
        start, outcomes = burst(cluster, BURST, f"burst {round_}")
        ok = [o for o in outcomes if o.code is grpc.StatusCode.OK]
        refused = [o for o in outcomes if o.code is grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(ok) + len(refused) == BURST, {o.code for o in outcomes}
        assert len(ok) >= CAPACITY // 2 and refused
        for o in refused:
            assert not o.token_ids and o.details  # before any token, with a reason
        refuse_s = sorted(o.ended_at - start for o in refused)
        p99 = refuse_s[max(0, int(0.99 * len(refuse_s)) - 1)]
        assert p99 < 3.0, f"refusals took up to {p99:.2f} s"
        burst_tpot = statistics.median(tpot_ms(o) for o in ok)
        assert burst_tpot < 2.0 * base_tpot, (burst_tpot, base_tpot)
        for name, p in procs.items():
            assert p.poll() is None, f"{name} died in the burst"
        assert_idle(cluster, expect_nodes=2)
        rss_after.append({name: rss_mib(p.pid) for name, p in procs.items()})
        print(
            f"burst {round_}: {len(ok)} admitted, {len(refused)} RESOURCE_EXHAUSTED "
            f"(p50 {statistics.median(refuse_s) * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms after "
            f"the burst began); admitted TPOT p50 {burst_tpot:.1f} ms vs {base_tpot:.1f} ms "
            f"unloaded; RSS MiB { ({k: round(v) for k, v in rss_after[-1].items()}) }"
        )
    for name in procs:
        # Bounded: the second burst leaves memory where the first did.
        assert rss_after[1][name] - rss_after[0][name] < 32, (name, rss_after)
        assert rss_after[1][name] - rss_before[name] < 128, (name, rss_before, rss_after)
    assert component(cluster, "decode-0").process.poll() is None
