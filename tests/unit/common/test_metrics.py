"""Metrics: the histogram, the collectors over fake node and router state, the
HTTP endpoint, and the port plan of `pdserve up`."""

from __future__ import annotations

import logging
import math
import random
import socket
import urllib.request
from dataclasses import fields
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.cluster.state import NodeInfo, NodeRole
from common.metrics.histogram import (
    E2E_BUCKETS,
    KV_BANDWIDTH_BUCKETS,
    KV_TRANSFER_BUCKETS,
    STEP_IDLE_BUCKETS,
    STEP_TOKEN_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
)
from common.metrics.node import COUNTERS, HISTOGRAMS, NodeCollector
from common.metrics.phases import PromptPhases
from common.metrics.server import make_registry, plan_metrics_ports, serve_metrics
from common.metrics.steps import StepHistograms
from decode_node.worker import DecodeStats
from engine.async_step import InFlightStep, StepLog, StepRecord
from engine.engine_stats import EngineStats
from engine.outputs import RequestMetrics
from engine.spec_decode.speculator import SpecDecodeStats
from engine.structured.compiler import COMPILE_SECONDS_BUCKETS, GrammarStats
from pdserve.redis_server import free_port
from prefill_node.worker import PrefillStats
from router.inflight import InflightTracker
from router.metrics import RouterCollector
from router.stats import RequestTrace, RouterStats


def scrape(*collectors) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of what a registry of ``collectors`` exposes."""
    from prometheus_client import generate_latest

    text = generate_latest(make_registry(collectors)).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels) -> float:
    """The one sample named ``name`` whose labels include ``labels``."""
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


# ------------------------------------------------------------------ histogram
def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram([0.1, 0.5, 1.0])
    h.observe(0.1)  # le is inclusive: lands in 0.1
    h.observe(0.3, count=2)
    h.observe_many([1.0, 7.0, 0.05])
    snap = h.snapshot()
    assert snap.buckets == [(0.1, 2), (0.5, 4), (1.0, 5), (math.inf, 6)]
    assert snap.count == h.count == 6
    assert snap.sum == pytest.approx(0.1 + 0.6 + 1.0 + 7.0 + 0.05)


def test_a_batch_counts_like_one_value_at_a_time():
    rng = random.Random(0)
    # Exact bucket bounds included: le is inclusive either way.
    values = [rng.choice(TOKEN_LATENCY_BUCKETS) for _ in range(200)]
    values += [rng.expovariate(20) for _ in range(2000)] + [99.0]
    batch, single = Histogram(TOKEN_LATENCY_BUCKETS), Histogram(TOKEN_LATENCY_BUCKETS)
    batch.observe_many(values)
    batch.observe_many([])
    for v in values:
        single.observe(v)
    assert batch.snapshot().buckets == single.snapshot().buckets
    assert batch.snapshot().sum == pytest.approx(single.snapshot().sum)


@pytest.mark.parametrize("bounds", [[], [1.0, 1.0], [2.0, 1.0], [1.0, math.inf]])
def test_histogram_rejects_bad_bounds(bounds):
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram(bounds)


@pytest.mark.parametrize(
    "buckets",
    [
        TTFT_BUCKETS,
        TOKEN_LATENCY_BUCKETS,
        E2E_BUCKETS,
        KV_TRANSFER_BUCKETS,
        KV_BANDWIDTH_BUCKETS,
        STEP_IDLE_BUCKETS,
        STEP_TOKEN_BUCKETS,
    ],
)
def test_bucket_sets_are_valid(buckets):
    Histogram(buckets)


# -------------------------------------------------------------------- router
def router_state():
    stats = RouterStats()
    return SimpleNamespace(stats=stats, inflight=InflightTracker()), stats


def test_router_exports_latency_histograms_and_final_statuses():
    routing, stats = router_state()
    ok = RequestTrace(start=10.0)
    ok.on_tokens(1, 10.2)  # TTFT 200 ms
    ok.on_tokens(2, 10.3)  # two tokens 100 ms later: ITL 50 ms each
    ok.on_tokens(1, 10.35)  # ITL 50 ms
    stats.routed("d0", "p0")
    stats.finished(ok, 10.4, "OK", prompt_tokens=40, cached_tokens=16)
    stats.routed("d0", None)
    stats.finished(RequestTrace(start=0.0), 1.0, "RESOURCE_EXHAUSTED")
    stats.redis_errors = 3
    stats.structured_by_kind["regex"] += 2
    s = scrape(RouterCollector(routing))

    assert value(s, "pdserve_router_requests_total", status="OK") == 1
    structured = "pdserve_router_structured_requests_total"
    assert value(s, structured, kind="regex") == 2 and value(s, structured, kind="json") == 0
    assert value(s, "pdserve_router_requests_total", status="RESOURCE_EXHAUSTED") == 1
    # Known statuses exist before they first happen (rate() needs the 0).
    assert value(s, "pdserve_router_requests_total", status="DEADLINE_EXCEEDED") == 0
    ttft = "pdserve_router_time_to_first_token_seconds"
    assert value(s, ttft + "_count") == 1  # failures are not timed
    assert value(s, ttft + "_sum") == pytest.approx(0.2)
    assert value(s, ttft + "_bucket", le="0.15") == 0
    assert value(s, ttft + "_bucket", le="0.2") == 1
    itl = "pdserve_router_inter_token_latency_seconds"
    assert value(s, itl + "_count") == 3 and value(s, itl + "_sum") == pytest.approx(0.15)
    tpot = "pdserve_router_time_per_output_token_seconds"
    assert value(s, tpot + "_sum") == pytest.approx(0.15 / 3)
    e2e = "pdserve_router_e2e_request_latency_seconds"
    assert value(s, e2e + "_count") == 1 and value(s, e2e + "_sum") == pytest.approx(0.4)
    assert value(s, "pdserve_router_prompt_tokens_total") == 40
    assert value(s, "pdserve_router_cached_prompt_tokens_total") == 16
    assert value(s, "pdserve_router_routed_requests_total", role="decode", node="d0") == 2
    assert value(s, "pdserve_router_routed_requests_total", role="prefill", node="p0") == 1
    assert value(s, "pdserve_router_local_prefills_total") == 1
    assert value(s, "pdserve_redis_errors_total", op="route") == 3
    assert value(s, "pdserve_router_requests_in_flight") == 0


# ---------------------------------------------------------------------- node
def engine_stats(**overrides) -> EngineStats:
    # Distinct values, so a field exported under the wrong name shows.
    base = dict(
        num_running=3,
        num_waiting=5,
        num_reserved=7,
        num_queued_prefill_tokens=11,
        num_kv_blocks=100,
        num_free_kv_blocks=60,
        num_cached_free_kv_blocks=13,
        num_preemptions=17,
        prefix_cache_queried_tokens=19,
        prefix_cache_hit_tokens=23,
        num_host_kv_blocks=29,
        num_free_host_kv_blocks=31,
        host_tier_hit_blocks=37,
        num_blocks_copied_to_host=41,
        num_blocks_copied_to_device=43,
        bytes_copied_to_host=53,
        bytes_copied_to_device=59,
        seconds_copying_to_device=0.25,
        num_swap_preemptions=61,
        num_swap_fallbacks=67,
        offloaded_weight_bytes=89,
        spec_decode=SpecDecodeStats(29, 71, 37, [29, 8]),
        # Compiles: 2 within 5 ms, 1 more within 1 s (cumulative), 83 s in all.
        grammar=GrammarStats(
            cache_hits=71,
            cache_misses=73,
            buckets=tuple(
                (b, 0 if b < 0.005 else 2 if b < 1 else 3)
                for b in (*COMPILE_SECONDS_BUCKETS, math.inf)
            ),
            sum=83.0,
            num_matchers=79,
        ),
    )
    return EngineStats(**(base | overrides))


def node_info(role=NodeRole.PREFILL) -> NodeInfo:
    return NodeInfo("p-1", role, "127.0.0.1:1", "smol", 16)


def test_node_exports_engine_snapshot_and_block_states():
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    s = scrape(NodeCollector(node_info(), engine))
    labels = {"role": "prefill", "node": "p-1"}
    assert value(s, "pdserve_requests_running", **labels) == 3
    assert value(s, "pdserve_requests_waiting", **labels) == 5
    assert value(s, "pdserve_requests_reserved", **labels) == 7
    assert value(s, "pdserve_queued_prefill_tokens", **labels) == 11
    assert value(s, "pdserve_kv_blocks_capacity", **labels) == 100
    # num_free_kv_blocks counts cached-free blocks too; the states partition the pool.
    free = value(s, "pdserve_kv_blocks", state="free")
    cached = value(s, "pdserve_kv_blocks", state="cached")
    used = value(s, "pdserve_kv_blocks", state="used")
    assert (free, cached, used) == (47, 13, 40)
    assert value(s, "pdserve_preemptions_total") == 17
    assert value(s, "pdserve_prefix_cache_queried_tokens_total") == 19
    assert value(s, "pdserve_prefix_cache_hit_tokens_total") == 23
    assert value(s, "pdserve_spec_decode_num_drafts_total") == 29
    assert value(s, "pdserve_spec_decode_num_draft_tokens_total") == 71
    assert value(s, "pdserve_spec_decode_num_accepted_tokens_total") == 37
    per_pos = [
        value(s, "pdserve_spec_decode_num_accepted_tokens_per_pos_total", position=p)
        for p in ("0", "1")
    ]
    assert per_pos == [29, 8]
    assert value(s, "pdserve_node_info", model="smol", block_size="16") == 1
    assert value(s, "pdserve_engine_alive") == 1 and value(s, "pdserve_node_draining") == 0
    assert value(s, "pdserve_grammar_cache_hits_total") == 71
    assert value(s, "pdserve_grammar_cache_misses_total") == 73
    assert value(s, "pdserve_grammar_matchers") == 79
    assert value(s, "pdserve_offloaded_weight_bytes") == 89
    compile_s = "pdserve_grammar_compile_duration_seconds"
    assert value(s, f"{compile_s}_bucket", le="0.005") == 2
    assert value(s, f"{compile_s}_bucket", le="+Inf") == value(s, f"{compile_s}_count") == 3
    assert value(s, f"{compile_s}_sum") == 83


def test_node_exports_the_host_tier():
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    s = scrape(NodeCollector(node_info(), engine))
    assert value(s, "pdserve_host_kv_blocks_capacity") == 29
    assert value(s, "pdserve_host_kv_blocks_free") == 31
    assert value(s, "pdserve_host_tier_hit_blocks_total") == 37
    assert value(s, "pdserve_kv_tier_copied_blocks_total", direction="to_host") == 41
    assert value(s, "pdserve_kv_tier_copied_blocks_total", direction="to_device") == 43
    assert value(s, "pdserve_kv_tier_copied_bytes_total", direction="to_host") == 53
    assert value(s, "pdserve_kv_tier_copied_bytes_total", direction="to_device") == 59
    assert value(s, "pdserve_kv_tier_copy_in_seconds_total") == 0.25
    assert value(s, "pdserve_swap_preemptions_total") == 61
    assert value(s, "pdserve_swap_fallbacks_total") == 67


def test_every_engine_stats_field_is_exported():
    engine = SimpleNamespace(stats=engine_stats(), alive=False)
    exported = set(scrape(NodeCollector(node_info(), engine)).values())
    derived = {47, 40}  # free without cached, used
    for f in fields(EngineStats):
        v = getattr(engine.stats, f.name)
        if f.name in ("num_free_kv_blocks",):
            assert derived <= exported
        elif f.name == "spec_decode":
            counts = {v.num_drafts, v.num_draft_tokens, v.num_accepted_tokens, *v.accepted_per_pos}
            assert counts <= exported
        elif f.name == "grammar":
            g = engine.stats.grammar
            assert {g.cache_hits, g.cache_misses, g.num_matchers, g.sum} <= exported
        else:
            assert v in exported, f"EngineStats.{f.name} is not exported"


def test_the_scrape_reads_the_latest_published_snapshot():
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    collector = NodeCollector(node_info(), engine)
    engine.stats = engine_stats(num_running=0, num_free_kv_blocks=100)  # the engine swapped it
    s = scrape(collector)
    assert value(s, "pdserve_requests_running") == 0
    assert value(s, "pdserve_kv_blocks", state="used") == 0


@pytest.mark.parametrize("stats", [PrefillStats(), DecodeStats()])
def test_every_worker_counter_has_a_decision(stats):
    # A counter added to a worker must be named here (or skipped with a reason).
    assert set(stats.counters()) <= set(COUNTERS)


def test_prefill_node_exports_counters_transfer_histograms_and_redis_errors():
    stats = PrefillStats(requests=4)
    stats.transferred(1_000_000, 0.004)  # 250 MB/s
    stats.transferred(0, 0.001)  # nothing to send (all cached on the decode node)
    stats.transfers_failed = 1
    assert set(stats.histograms()) <= set(HISTOGRAMS)
    heartbeat = SimpleNamespace(published=9, consecutive_failures=2, failures=5)
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    s = scrape(NodeCollector(node_info(), engine, heartbeat, stats.counters, stats.histograms))
    assert value(s, "pdserve_node_requests_total") == 4
    assert value(s, "pdserve_kv_transfers_total") == 2
    assert value(s, "pdserve_kv_transfer_bytes_total") == 1_000_000
    assert value(s, "pdserve_kv_transfer_failures_total") == 1
    dur = "pdserve_kv_transfer_duration_seconds"
    assert value(s, dur + "_count") == 2 and value(s, dur + "_sum") == pytest.approx(0.005)
    assert value(s, dur + "_bucket", le="0.001") == 1
    bw = "pdserve_kv_transfer_bandwidth_bytes_per_second"
    assert value(s, bw + "_count") == 1  # the empty push has no rate
    assert value(s, bw + "_bucket", le="2.5e+08") == 1
    assert value(s, bw + "_bucket", le="1e+08") == 0
    assert value(s, "pdserve_heartbeats_total") == 9
    assert value(s, "pdserve_heartbeat_consecutive_failures") == 2
    assert value(s, "pdserve_redis_errors_total", op="heartbeat", role="prefill") == 5
    assert value(s, "pdserve_kv_gathers_copy_engine_total") == 0  # no GPU: no copy engines
    assert not [k for k in s if k[0] == "pdserve_kv_transfer_us_total"]


def test_a_prefill_node_exports_its_copy_engines_gathers():
    copier = SimpleNamespace(gathers=0)  # engine/copy_engine.py's count, read at scrape time
    stats = PrefillStats(copier=copier)
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    collector = NodeCollector(node_info(), engine, None, stats.counters, stats.histograms)
    assert value(scrape(collector), "pdserve_kv_gathers_copy_engine_total") == 0
    copier.gathers = 12
    assert value(scrape(collector), "pdserve_kv_gathers_copy_engine_total") == 12


def test_decode_node_exports_its_counters():
    stats = DecodeStats(requests=3, transfers_landed=2, late_transfers=1, bytes_received=4096)
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    info = NodeInfo("d-1", NodeRole.DECODE, "127.0.0.1:2", "smol", 16)
    s = scrape(NodeCollector(info, engine, counters=stats.counters))
    labels = {"role": "decode", "node": "d-1"}
    assert value(s, "pdserve_kv_transfers_total", **labels) == 2
    assert value(s, "pdserve_kv_late_transfers_total", **labels) == 1
    assert value(s, "pdserve_kv_transfer_bytes_total", **labels) == 4096
    assert value(s, "pdserve_kv_checksum_mismatches_total", **labels) == 0


@pytest.mark.parametrize("stats", [PrefillStats(), DecodeStats()])
def test_a_computed_prompts_queue_and_prefill_time_are_exported(stats):
    # Received at 10.0, admitted at 10.25, first token at 10.3 (engine stamps).
    phases = PromptPhases.of(RequestMetrics(10.0, 10.3, None, first_scheduled_time=10.25))
    assert phases.queue_s == pytest.approx(0.25) and phases.prefill_s == pytest.approx(0.05)
    stats.phases.observe(phases)
    stats.phases.observe(PromptPhases(0.0, 2.0))
    assert set(stats.histograms()) <= set(HISTOGRAMS)
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    s = scrape(NodeCollector(node_info(), engine, None, stats.counters, stats.histograms))
    queue, prefill = "pdserve_request_queue_time_seconds", "pdserve_request_prefill_time_seconds"
    assert value(s, queue + "_count") == 2 and value(s, queue + "_sum") == pytest.approx(0.25)
    assert value(s, queue + "_bucket", le="0.005") == 1  # the one that waited 0
    assert value(s, queue + "_bucket", le="0.3") == 2
    assert value(s, prefill + "_sum") == pytest.approx(2.05)
    assert (
        value(s, prefill + "_bucket", le="0.06") == 1
        and value(s, prefill + "_bucket", le="2.5") == 2
    )


def test_step_sizes_and_device_idle_are_exported():
    """The engine's step log, drained into the node's histograms: tokens per step,
    and the device's idle before each step as one family labelled by step kind
    (unmeasured steps counted in the first only); `pdserve bench serve
    --scrape-metrics` reads every series."""
    from prometheus_client import generate_latest

    from pdserve.bench.scrape import parse

    log = StepLog()
    log.entries.extend(
        [
            StepRecord(1090, True, 0.012),
            StepRecord(64, False, 0.0),
            StepRecord(64, False, 0.0003),
            StepRecord(2048, True, 0.004),
            StepRecord(5, True, None),  # queued behind nothing: no idle figure
        ]
    )
    steps = StepHistograms()
    steps.drain(log)
    assert not log.entries  # taken
    steps.drain(log)  # nothing new: nothing observed twice
    engine = SimpleNamespace(stats=engine_stats(), alive=True)
    collector = NodeCollector(node_info(), engine, steps=steps)
    s = scrape(collector)
    tokens = "pdserve_engine_step_tokens"
    assert value(s, tokens + "_count") == 5 and value(s, tokens + "_sum") == 3271
    assert value(s, tokens + "_bucket", le="64.0") == 3
    assert value(s, tokens + "_bucket", le="2048.0") == 5
    idle = "pdserve_engine_idle_before_step_seconds"
    assert value(s, idle + "_count", step="prompt") == 2
    assert value(s, idle + "_sum", step="prompt") == pytest.approx(0.016)
    assert value(s, idle + "_bucket", step="prompt", le="0.005") == 1
    assert value(s, idle + "_count", step="decode") == 2
    assert value(s, idle + "_bucket", step="decode", le="0.0001") == 1
    series = parse(generate_latest(make_registry([collector])).decode())
    labels = f'node="{node_info().node_id}",role="prefill"'
    assert {k for k in series if k.startswith("pdserve_engine_")} == {
        f"{tokens}{{{labels}}}",
        f'{idle}{{{labels},step="decode"}}',
        f'{idle}{{{labels},step="prompt"}}',
    }


def test_step_log_is_bounded_and_has_no_idle_for_untimed_steps():
    from engine.scheduler import ScheduledBatch

    log = StepLog()
    batch = ScheduledBatch(num_new_tokens=[7, 1])
    batch.seqs.extend([object(), object()])  # only counted
    cpu_step = InFlightStep(batch, [], None, None)  # no CUDA events
    assert cpu_step.idle_seconds() is None
    log.observe(cpu_step)
    assert log.take() == [StepRecord(8, True, None)]
    log.entries.extend(StepRecord(1, False, 0.0) for _ in range(5000))
    assert len(log.take()) == 4096 and log.take() == []


def test_no_phases_before_the_first_token_and_none_negative():
    assert PromptPhases.of(RequestMetrics(1.0, None, None, first_scheduled_time=1.1)) is None
    # Never stamped as scheduled (a prompt committed with its KV already there):
    # no queue of its own, all prefill.
    p = PromptPhases.of(RequestMetrics(1.0, 1.5, None))
    assert (p.queue_s, p.prefill_s) == (0.0, 0.5)


# -------------------------------------------------------------------- server
def test_metrics_endpoint_serves_the_registry_over_http():
    routing, stats = router_state()
    stats.finished(RequestTrace(start=0.0), 1.0, "CANCELLED")
    server = serve_metrics(free_port(), "127.0.0.1", [RouterCollector(routing)])
    assert server is not None
    try:
        with urllib.request.urlopen(server.url, timeout=5) as r:
            assert r.status == 200
            text = r.read().decode()
        assert server.url.endswith("/metrics")
        assert 'pdserve_router_requests_total{status="CANCELLED"} 1.0' in text
        # One explicit registry: no default process/platform/gc collectors.
        assert "process_cpu_seconds_total" not in text and "python_gc" not in text
    finally:
        server.close()


def test_port_zero_disables_and_a_busy_port_is_logged_not_fatal(caplog):
    routing, _ = router_state()
    assert serve_metrics(0, "127.0.0.1", [RouterCollector(routing)]) is None
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger="common.metrics.server"):
            assert serve_metrics(port, "127.0.0.1", [RouterCollector(routing)]) is None
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text


def test_port_plan_for_processes_sharing_a_host():
    names = ["router", "decode-0", "decode-1", "prefill-0"]
    assert plan_metrics_ports(9400, names, None) == {
        "router": 9400,
        "decode-0": 9401,
        "decode-1": 9402,
        "prefill-0": 9403,
    }
    assert set(plan_metrics_ports(0, names, None).values()) == {0}
    free = iter([5001, 5002, 5003, 5004])
    assert list(plan_metrics_ports(None, names, lambda: next(free)).values()) == [
        5001,
        5002,
        5003,
        5004,
    ]
    with pytest.raises(ValueError, match="exceed 65535"):
        plan_metrics_ports(65534, names, None)
