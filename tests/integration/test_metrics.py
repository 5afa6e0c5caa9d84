"""Every process's /metrics on a real local cluster (router, one prefill and one
decode node as processes, a real redis-server, KV over gloo): after a few
requests, what each endpoint says must agree with what the clients saw. The
decode node speculates (n-gram, lossless): the last test checks it on the
disaggregated path and what /metrics and pdctl stats say of it."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc
from proto.client import generate
from router.admin.pdctl import stats_text
from tests.conftest import REMOTE_PREFILL_ONLY

pytestmark = pytest.mark.timeout(600)

MAX_LEN = 512
# Long enough for a few full blocks, so the second one hits the prefill node's cache.
SHARED = "You are a helpful assistant. Answer briefly and precisely. " * 4
PROMPTS = [SHARED + "What is the capital of France?", SHARED + "Name a red fruit.", "Hi"]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    spec = ClusterSpec(
        model=str(demo_model_dir),
        num_prefill=1,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", str(MAX_LEN)],
        node_args=["--heartbeat-interval", "0.2"],
        decode_args=["--speculative-config", json.dumps(SPEC)],
        # Always disaggregate, so every request moves KV from prefill to decode.
        router_args=REMOTE_PREFILL_ONLY,
        log_dir=str(tmp_path_factory.mktemp("metrics-logs")),
        start_timeout_s=300,
        metrics_port=None,  # a free port per process
    )
    with LocalCluster(spec) as c:
        yield c


def component(cluster, name):
    return next(c for c in cluster.components if c.name == name)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
    except OSError as e:
        pytest.fail(f"cannot scrape {url}: {e}")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name, **labels) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def run(address, prompt, **kw):
    tokens, final = 0, None
    for r in generate(address, prompt, timeout=120, temperature=0.0, **kw):
        tokens += sum(len(d.token_ids) for d in r.deltas)
        if r.HasField("final"):
            final = r.final
    return tokens, final


@pytest.fixture(scope="module")
def traffic(cluster):
    """Sequential requests (the second shares the first's prefix) and one invalid one."""
    results = [run(cluster.router_address, p, max_tokens=8) for p in PROMPTS]
    with pytest.raises(grpc.RpcError) as e:
        run(cluster.router_address, "x", max_tokens=-1)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    return results


def test_every_process_serves_metrics_on_its_own_port(cluster):
    ports = [c.metrics_port for c in cluster.components]
    assert len(cluster.components) == 3 and all(ports) and len(set(ports)) == 3
    for c in cluster.components:
        assert c.metrics_url.endswith("/metrics")
        samples = scrape(c.metrics_url)
        if c.name == "router":
            assert ("pdserve_router_requests_in_flight", ()) in samples
        else:
            role = c.name.split("-")[0]
            assert value(samples, "pdserve_node_info", role=role, node=c.name) == 1
            assert value(samples, "pdserve_engine_alive") == 1
            # Exported from the start; a CPU engine measures no idle (CUDA events).
            idle = "pdserve_engine_idle_before_step_seconds_count"
            assert value(samples, idle, step="prompt") == value(samples, idle, step="decode") == 0
        # Start-up's heap is frozen (--gc-freeze): torch, the model, grpc.
        assert value(samples, "pdserve_gc_frozen_objects") > 10_000, c.name


def test_router_counts_and_times_every_request(cluster, traffic):
    s = scrape(component(cluster, "router").metrics_url)
    n = len(PROMPTS)
    assert value(s, "pdserve_router_requests_total", status="OK") == n
    assert value(s, "pdserve_router_requests_total", status="INVALID_ARGUMENT") == 1
    assert value(s, "pdserve_router_time_to_first_token_seconds_count") == n
    assert value(s, "pdserve_router_e2e_request_latency_seconds_count") == n
    assert value(s, "pdserve_router_time_to_first_token_seconds_bucket", le="+Inf") == n
    tokens = [t for t, _ in traffic]
    assert value(s, "pdserve_router_inter_token_latency_seconds_count") == sum(tokens) - n
    assert value(s, "pdserve_router_time_per_output_token_seconds_count") == sum(
        t > 1 for t in tokens
    )
    # TTFT sums to what the router stamped on each Final (ms), to rounding.
    stamped = sum(f.usage.time_to_first_token_ms for _, f in traffic) / 1e3
    assert value(s, "pdserve_router_time_to_first_token_seconds_sum") == pytest.approx(
        stamped, rel=1e-3
    )
    prompt = sum(f.usage.prompt_tokens for _, f in traffic)
    cached = sum(f.usage.cached_tokens for _, f in traffic)
    assert value(s, "pdserve_router_prompt_tokens_total") == prompt
    assert value(s, "pdserve_router_cached_prompt_tokens_total") == cached > 0
    assert value(s, "pdserve_router_routed_requests_total", role="prefill", node="prefill-0") == n
    assert value(s, "pdserve_router_routed_requests_total", role="decode", node="decode-0") == n
    assert value(s, "pdserve_redis_errors_total", op="route") == 0
    assert value(s, "pdserve_router_requests_in_flight") == 0


def test_kv_transfer_seen_from_both_ends(cluster, traffic):
    n = len(PROMPTS)
    p = scrape(component(cluster, "prefill-0").metrics_url)
    d = scrape(component(cluster, "decode-0").metrics_url)
    assert value(p, "pdserve_node_requests_total") == value(d, "pdserve_node_requests_total") == n
    assert value(p, "pdserve_kv_transfers_total") == value(d, "pdserve_kv_transfers_total") == n
    sent = value(p, "pdserve_kv_transfer_bytes_total")
    assert sent > 0 and value(d, "pdserve_kv_transfer_bytes_total") == sent
    assert value(p, "pdserve_kv_transfer_duration_seconds_count") == n
    assert value(p, "pdserve_kv_transfer_duration_seconds_sum") > 0
    assert value(p, "pdserve_kv_transfer_bandwidth_bytes_per_second_count") == n
    for s in (p, d):
        assert value(s, "pdserve_kv_transfer_failures_total") == 0
        assert value(s, "pdserve_redis_errors_total", op="heartbeat") == 0
        assert value(s, "pdserve_heartbeats_total") > 0
    assert value(d, "pdserve_kv_late_transfers_total") == 0
    # Every prompt's tokens went through the prefill node's steps (less the
    # cached ones); the decode node's steps ran the generated tokens.
    computed = value(p, "pdserve_prefix_cache_queried_tokens_total") - value(
        p, "pdserve_prefix_cache_hit_tokens_total"
    )
    assert value(p, "pdserve_engine_step_tokens_sum") == computed
    assert value(p, "pdserve_engine_step_tokens_count") >= 1
    assert value(d, "pdserve_engine_step_tokens_count") >= 1
    # The second prompt reused the first's blocks on the prefill node.
    assert value(p, "pdserve_prefix_cache_hit_tokens_total") > 0
    assert value(p, "pdserve_prefix_cache_queried_tokens_total") >= value(
        p, "pdserve_prefix_cache_hit_tokens_total"
    )


def test_at_idle_free_plus_cached_blocks_equal_capacity(cluster, traffic):
    for name in ("prefill-0", "decode-0"):
        url = component(cluster, name).metrics_url
        deadline = time.monotonic() + 15
        while True:  # the engine publishes its snapshot after the last step/command
            s = scrape(url)
            used = value(s, "pdserve_kv_blocks", state="used")
            if used == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        free = value(s, "pdserve_kv_blocks", state="free")
        cached = value(s, "pdserve_kv_blocks", state="cached")
        capacity = value(s, "pdserve_kv_blocks_capacity")
        assert (used, free + cached) == (0, capacity), name
        assert cached > 0, name  # finished prompts stay in the prefix cache
        for gauge in ("running", "waiting", "reserved"):
            assert value(s, f"pdserve_requests_{gauge}") == 0, (name, gauge)
        assert value(s, "pdserve_queued_prefill_tokens") == 0


def test_the_decode_node_speculates_on_remotely_prefilled_requests(cluster, traffic):
    """A prompt the prefill node prefills, decoded with speculation and opted
    out of it (disable_spec_decode): the same greedy tokens; only the first
    proposed anything; /metrics and pdctl stats show the acceptance. Last in
    the module: the tests above count requests exactly."""
    text = "one two three four five six seven eight nine ten. " * 3
    d_url = component(cluster, "decode-0").metrics_url
    p_url = component(cluster, "prefill-0").metrics_url
    drafts, accepted = (
        "pdserve_spec_decode_num_draft_tokens_total",
        "pdserve_spec_decode_num_accepted_tokens_total",
    )

    def tokens(**kw) -> list[int]:
        out = []
        for r in generate(cluster.router_address, text, timeout=120, temperature=0.0,
                          max_tokens=16, ignore_eos=True, **kw):  # fmt: skip
            out.extend(t for d in r.deltas for t in d.token_ids)
        return out

    before, prefilled = scrape(d_url), value(scrape(p_url), "pdserve_node_requests_total")
    plain = tokens(disable_spec_decode=True)
    opted_out = scrape(d_url)
    assert value(opted_out, drafts) == value(before, drafts)  # it proposed nothing
    assert tokens() == plain
    after = scrape(d_url)
    assert value(after, accepted) > value(before, accepted)
    assert value(scrape(p_url), "pdserve_node_requests_total") == prefilled + 2
    deadline = time.monotonic() + 15
    with grpc.insecure_channel(cluster.admin_address) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        while True:  # the router reads the counters from the node's heartbeat
            stats = stub.Stats(admin_pb2.StatsRequest(), timeout=10)
            if stats.spec_accepted_tokens >= value(after, accepted) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert stats.spec_draft_tokens == value(after, drafts)
    assert stats.spec_accepted_tokens == value(after, accepted)
    shown = (
        f"speculative decoding: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} "
        "proposed tokens accepted"
    )
    assert shown in stats_text(stats)  # what pdctl stats prints
