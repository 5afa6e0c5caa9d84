"""`pdserve bench serve` against a live `pdserve up` on the demo model: a tiny
sweep over gRPC (records, plot), failures counted when the only decode node is
drained mid-run, and the same sweep over OpenAI HTTP once the router serves it."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import threading

import grpc
import pytest

from pdserve.bench.backends import GrpcBackend, SamplingOptions
from pdserve.bench.datasets import Dataset, DatasetKind, random_requests
from pdserve.bench.loadgen import run_rate
from pdserve.bench.metrics import compute
from pdserve.cli import main as pdserve_main
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.timeout(600)


def _router_has_http() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "router", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return "--http-port" in out.stdout


HTTP = _router_has_http()


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    http_port = free_port()
    spec = ClusterSpec(
        model=str(demo_model_dir),
        num_prefill=1,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", "512"],
        node_args=["--heartbeat-interval", "0.2"],
        router_args=["--http-port", str(http_port)] if HTTP else [],
        log_dir=str(tmp_path_factory.mktemp("serve-logs")),
    )
    with LocalCluster(spec) as c:
        c.http_base_url = f"http://127.0.0.1:{http_port}"
        yield c


SWEEP = (
    ["--dataset", "random", "--random-input-len", "24", "--random-output-len", "4"]
    + ["--ignore-eos", "--num-prompts", "6", "--request-rate", "20", "inf"]
    + ["--slo", "ttft:60000,tpot:60000", "--no-progress"]
)


def _check_sweep(tmp_path, label: str) -> None:
    (path,) = tmp_path.glob(f"serve-{label}-random-*.json")
    rec = json.loads(path.read_text())
    assert [r["request_rate"] for r in rec["rates"]] == [20, "inf"]
    for r in rec["rates"]:
        assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
        # --ignore-eos: exactly the asked lengths; the server's usage counts prompts.
        assert r["total_output_tokens"] == 24
        assert r["total_input_tokens"] >= 6 * 24
        assert 0 < r["ttft_ms"]["p50"] <= r["e2el_ms"]["p50"]
        assert r["tpot_ms"]["p50"] > 0 and r["itl_ms"]["p50"] > 0
        assert r["goodput"] == pytest.approx(r["request_throughput"])  # a loose SLO
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grpc_sweep_writes_records_and_a_plot(cluster, demo_model_dir, tmp_path):
    nodes = [c for c in cluster.components if c.name.startswith(("prefill", "decode"))]
    scrape = [arg for c in nodes for arg in ("--scrape-metrics", c.metrics_url)]
    code = pdserve_main(
        ["bench", "serve", "--backend", "grpc", "--address", cluster.router_address]
        + ["--label", "grpc", "--model-dir", str(demo_model_dir), "--result-dir", str(tmp_path)]
        + SWEEP
        + scrape
    )
    assert code == 0
    _check_sweep(tmp_path, "grpc")
    (path,) = tmp_path.glob("serve-grpc-random-*.json")
    for r in json.loads(path.read_text())["rates"]:
        # The node that computed each prompt says where its first token went
        # (Usage.timing), and that fits inside the TTFT the client saw.
        queue, prefill = r["server_queue_ms"], r["server_prefill_ms"]
        assert queue["p50"] >= 0 and prefill["p50"] > 0
        assert queue["mean"] + prefill["mean"] <= r["ttft_ms"]["mean"]
        # Each node's /metrics over this rate only: every prompt was computed
        # once, by the decode node itself or by the prefill node.
        observed = r["server_histograms"]
        assert sorted(observed) == sorted(c.metrics_url for c in nodes)
        prefill_series = [
            s
            for series in observed.values()
            for key, s in series.items()
            if key.startswith("pdserve_request_prefill_time_seconds{")
        ]
        assert sum(s["count"] for s in prefill_series) == 6, observed
        # The histograms and the replies' timing are the same observations.
        weighted = sum(s["count"] * s["mean"] for s in prefill_series) / 6
        assert weighted == pytest.approx(prefill["mean"], rel=1e-6)


@pytest.mark.skipif(
    not HTTP,
    reason="`pdserve router --help` has no --http-port: the OpenAI HTTP API is not merged yet",
)
def test_http_sweep_writes_records_and_a_plot(cluster, demo_model_dir, tmp_path):
    code = pdserve_main(
        ["bench", "serve", "--backend", "openai", "--base-url", cluster.http_base_url]
        + ["--label", "http", "--model-dir", str(demo_model_dir), "--result-dir", str(tmp_path)]
        + SWEEP
    )
    assert code == 0
    _check_sweep(tmp_path, "http")


def test_requests_after_a_drain_are_counted_as_failures(cluster, demo_model_dir):
    vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    dataset = Dataset(DatasetKind.RANDOM, random_requests(16, 24, 4, vocab, seed=5))
    with grpc.insecure_channel(cluster.admin_address) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        (node,) = [
            n for n in admin.ListNodes(admin_pb2.ListNodesRequest()).nodes if n.role == "decode"
        ]
        drained = threading.Event()
        done = []

        def on_done(r) -> None:
            # After three answers, drain the only decode node: every later
            # request has nowhere to go and must show up as a failure.
            done.append(r)
            if len(done) == 3 and not drained.is_set():
                admin.Drain(admin_pb2.DrainRequest(node_id=node.node_id), timeout=30)
                drained.set()

        async def go():
            backend = GrpcBackend(cluster.router_address, SamplingOptions(timeout_s=120))
            try:
                # One at a time, so that the requests after the third are sent
                # after the drain however slow the host is (at 4 req/s and no
                # bound, a loaded 2-core host had sent all 16 before the third
                # answer came back, and none failed).
                return await run_rate(
                    backend, dataset, 4.0, max_concurrency=1, seed=1, on_done=on_done
                )
            finally:
                await backend.close()

        try:
            run = asyncio.run(go())
        finally:
            admin.Undrain(admin_pb2.DrainRequest(node_id=node.node_id), timeout=30)
    m = compute(run.results, run.duration_s, 4.0)
    assert drained.is_set()
    assert m.completed + m.failed == 16
    assert m.completed >= 3 and m.failed >= 1
    assert all(e.startswith("UNAVAILABLE") for e in m.errors), m.errors
    assert len(m.failures) == m.failed and sum(m.errors.values()) == m.failed
    assert not math.isnan(m.ttft_ms["p50"])
