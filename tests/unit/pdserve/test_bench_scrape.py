"""`pdserve bench serve --scrape-metrics`: server histograms over one rate, read
from a real Prometheus endpoint (prometheus-client's own HTTP server)."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from common.runtime.ports import free_port
from pdserve.bench.scrape import Scraper, delta, parse, quantile, quantile_bucket

BUCKETS = (0.01, 0.02, 0.05, 0.1)


@pytest.fixture()
def endpoint():
    """A live /metrics with one labelled seconds histogram and one plain one."""
    registry = CollectorRegistry()
    queue = Histogram("demo_queue_time_seconds", "q", ["node"], buckets=BUCKETS, registry=registry)
    tokens = Histogram("demo_tokens", "t", buckets=(10, 100), registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{port}/metrics", queue, tokens
    finally:
        server.shutdown()
        thread.join(5)


def test_a_rate_sees_only_what_was_observed_during_it(endpoint):
    url, queue, tokens = endpoint
    for v in (0.005, 0.5):  # before the rate: must not count
        queue.labels(node="d0").observe(v)

    async def go():
        scraper = await Scraper.start([url])
        try:
            before = await scraper.snapshot()
            for v in (0.015, 0.015, 0.015, 0.03, 0.07):
                queue.labels(node="d0").observe(v)
            tokens.observe(50)
            return await scraper.since(before)
        finally:
            await scraper.close()

    (observed,) = (asyncio.run(go())).values()
    q = observed['demo_queue_time_seconds{node="d0"}']
    assert q["count"] == 5 and q["unit"] == "ms"
    assert q["mean"] == pytest.approx((3 * 15 + 30 + 70) / 5)
    # Rank 2.5 of 5 falls in (10, 20] ms, which holds 3 of them: 10 + 10 * 2.5 / 3.
    assert q["p50"] == pytest.approx(10 + 10 * 2.5 / 3)
    # Rank 4.5 falls in (50, 100] ms, which holds the fifth: 50 + 50 * 0.5.
    assert q["p90"] == pytest.approx(75)
    assert q["p50_bucket"] == pytest.approx([10, 20]) and q["p90_bucket"] == pytest.approx(
        [50, 100]
    )
    t = observed["demo_tokens"]
    assert t["count"] == 1 and t["mean"] == 50 and t["unit"] == ""


def test_a_series_that_saw_nothing_is_left_out():
    text = (
        "# TYPE x_seconds histogram\n"
        'x_seconds_bucket{le="0.1"} 2\nx_seconds_bucket{le="+Inf"} 3\n'
        "x_seconds_count 3\nx_seconds_sum 0.9\n"
    )
    snap = parse(text)
    assert delta(snap, snap) == {}
    assert delta({}, snap)["x_seconds"]["count"] == 3


def test_quantile_follows_histogram_quantile():
    buckets = [(0.1, 2.0), (0.2, 2.0), (1.0, 4.0), (math.inf, 5.0)]
    assert quantile(buckets, 0.2) == pytest.approx(0.05)  # rank 1 of 2 in (0, 0.1]
    assert quantile(buckets, 0.6) == pytest.approx(0.2 + 0.8 * 0.5)  # rank 3 in (0.2, 1]
    assert quantile(buckets, 0.95) == 1.0  # in +Inf: the last finite bound
    assert math.isnan(quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5))


def test_quantile_bucket_bounds_the_estimate():
    buckets = [(0.1, 2.0), (0.2, 2.0), (1.0, 4.0), (math.inf, 5.0)]
    assert quantile_bucket(buckets, 0.2) == (0.0, 0.1)
    assert quantile_bucket(buckets, 0.6) == (0.2, 1.0)
    assert quantile_bucket(buckets, 0.95) == (1.0, math.inf)
    assert all(math.isnan(b) for b in quantile_bucket([(0.1, 0.0), (math.inf, 0.0)], 0.5))


def test_a_coarse_bucket_is_printed_with_its_bounds():
    # vLLM's queue-time histogram: microsecond queues all land in (0, 0.3] s, so
    # the interpolated p50 (150 ms) is an artefact; the line shows the bucket.
    text = (
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        'vllm:request_queue_time_seconds_bucket{le="0.3"} 10\n'
        'vllm:request_queue_time_seconds_bucket{le="+Inf"} 10\n'
        "vllm:request_queue_time_seconds_count 10\n"
        "vllm:request_queue_time_seconds_sum 0.0001\n"
    )
    observed = {"http://x/metrics": delta({}, parse(text))}
    line = Scraper.lines(observed)
    assert (
        "mean 0.0 ms" in line
        and "p50 150.0 ms in (0, 300]" in line
        and "p90 270.0 ms in (0, 300]" in line
    )


def test_an_endpoint_that_cannot_be_read_stops_the_run_before_any_load():
    url = f"http://127.0.0.1:{free_port()}/metrics"  # nothing listens there
    with pytest.raises(SystemExit, match=f"--scrape-metrics {url}"):
        asyncio.run(Scraper.start([url]))


def test_an_endpoint_lost_mid_run_is_recorded_not_fatal(endpoint):
    url, _, _ = endpoint

    async def go():
        scraper = await Scraper.start([url])
        try:
            before = await scraper.snapshot()
            before[url] = "--scrape-metrics: lost"  # as snapshot() records a failed read
            return await scraper.since(before)
        finally:
            await scraper.close()

    assert asyncio.run(go()) == {url: {"error": "--scrape-metrics: lost"}}
    assert "lost" in Scraper.lines({url: {"error": "--scrape-metrics: lost"}})
