"""`pdserve bench serve` against a scripted fake OpenAI server: the metric
arithmetic with known delays, failures counted, the arrival process, the
record and the plot."""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import statistics

import pytest

from benchmarks.support.serve_fake_server import FakeServer, Script
from pdserve.bench.backends import OpenAIBackend, RequestResult, SamplingOptions
from pdserve.bench.datasets import (
    BenchRequest,
    Dataset,
    DatasetKind,
    MultiTurnSpec,
    MultiTurnWorkload,
)
from pdserve.bench.loadgen import arrival_gaps, run_rate
from pdserve.bench.metrics import SloMetric, compute, parse_slo, percentile
from pdserve.cli import main as pdserve_main

# The server sleeps the scripted delays, so a measured time is never below its
# script; above it by at most SLACK_MS (2 CI cores shared with other jobs).
SLACK_MS = 150


def _jsonl(tmp_path, lines: list[dict]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _within(measured: float, scripted: float, slack: float = SLACK_MS) -> bool:
    return scripted - 1 <= measured <= scripted + slack


def test_metrics_match_the_scripted_delays(tmp_path):
    fast = {"prompt": "ttft=0.05 itl=0.01 a b c", "output_len": 6}
    slow = {"prompt": "ttft=0.5 itl=0.1 a b c", "output_len": 6}
    fail = {"prompt": "fail=1", "output_len": 6}
    path = _jsonl(tmp_path, [fast] * 4 + [slow] * 2 + [fail])
    with FakeServer() as server:
        code = pdserve_main(
            ["bench", "serve", "--base-url", server.base_url, "--dataset", "jsonl"]
            + ["--jsonl-path", str(path), "--num-prompts", "7", "--request-rate", "inf"]
            + ["--slo", "ttft:250,tpot:50", "--result-dir", str(tmp_path), "--no-progress"]
        )
        assert server.requests() == 7
    assert code == 0
    rec = json.loads(next(tmp_path.glob("serve-openai-jsonl-*.json")).read_text())
    (r,) = rec["rates"]
    assert r["request_rate"] == "inf"
    assert r["completed"] == 6 and r["failed"] == 1
    assert list(r["errors"]) == ['HTTP 500: {"error": {"message": "scripted failure"}}']
    assert r["failures"][0]["error"].startswith("HTTP 500")
    assert r["total_output_tokens"] == 36 and r["total_input_tokens"] == 6 * 5
    # TTFT: four at 50 ms, two at 500 ms; p50 is a fast one, p90 a slow one.
    assert _within(r["ttft_ms"]["p50"], 50) and _within(r["ttft_ms"]["p90"], 500)
    assert _within(r["ttft_ms"]["mean"], (4 * 50 + 2 * 500) / 6)
    # TPOT = (e2e - ttft) / (6 - 1): the five gaps of 10 or 100 ms.
    assert _within(r["tpot_ms"]["p50"], 10, SLACK_MS / 5)
    assert _within(r["tpot_ms"]["p99"], 100, SLACK_MS / 5)
    assert _within(r["tpot_ms"]["mean"], (4 * 10 + 2 * 100) / 6, SLACK_MS / 5)
    # ITL pools every gap: 20 of 10 ms, 10 of 100 ms; the mean is what they sum to.
    assert _within(r["itl_ms"]["mean"], (20 * 10 + 10 * 100) / 30, SLACK_MS / 5)
    assert _within(r["e2el_ms"]["p99"], 500 + 5 * 100, 2 * SLACK_MS)
    # Everything was sent at once, so the slowest request bounds the duration.
    assert 1.0 <= r["duration_s"] <= 1.0 + 2 * SLACK_MS / 1e3
    assert r["request_throughput"] == pytest.approx(6 / r["duration_s"])
    # Goodput: only the four fast requests meet TTFT <= 250 and TPOT <= 50.
    assert r["goodput"] == pytest.approx(4 / r["duration_s"])
    assert r["output_tokens_per_s_per_user"] == pytest.approx(1e3 / r["tpot_ms"]["mean"])
    assert next(tmp_path.glob("serve-*.png")).read_bytes()[:4] == b"\x89PNG"


def test_metric_arithmetic_is_exact_on_known_results():
    def req(ttft, itls, tokens, ok=True):
        lat = ttft + sum(itls)
        return RequestResult(ok, "" if ok else "boom", 10, tokens, ttft, lat, list(itls))

    results = [
        req(0.1, [0.02] * 4, 5),  # TPOT 20 ms
        req(0.3, [0.05] * 4, 5),  # TPOT 50 ms: misses tpot:40
        req(0.2, [], 1),  # one token: no TPOT, meets any TPOT objective
        req(0.0, [], 0, ok=False),
    ]
    m = compute(results, 2.0, 4.0, parse_slo("ttft:250,tpot:40"), max_concurrency=3)
    assert (m.completed, m.failed, m.errors) == (3, 1, {"boom": 1})
    assert m.request_throughput == 1.5 and m.goodput == 1.0  # 2 good of 3 in 2 s
    assert m.output_throughput == 5.5 and m.total_token_throughput == 20.5
    assert m.ttft_ms["mean"] == pytest.approx(200) and m.ttft_ms["p50"] == pytest.approx(200)
    assert m.ttft_ms["p90"] == pytest.approx(280)  # 200 + 0.8 x (300 - 200)
    assert m.tpot_ms["mean"] == pytest.approx(35) and m.tpot_ms["p99"] == pytest.approx(49.7)
    assert m.itl_ms["mean"] == pytest.approx(35) and m.itl_ms["p50"] == pytest.approx(35)
    assert m.e2el_ms["p50"] == pytest.approx(200)
    assert m.output_tokens_per_s_per_user == pytest.approx(1e3 / 35)


def test_a_sweep_writes_one_entry_per_rate_and_plots_two_systems(tmp_path, monkeypatch):
    import pdserve.bench.devices as devices

    # The server's device: a label given, else this host's GPUs (two, here).
    monkeypatch.setattr(devices, "local_gpus", lambda: ["NVIDIA H100 80GB HBM3"] * 2)
    with FakeServer(Script(ttft_s=0.01, itl_s=0.002)) as server:
        for label, device in (("a", ["--server-device", "NVIDIA H200"]), ("b", [])):
            pdserve_main(
                ["bench", "serve", "--base-url", server.base_url, "--label", label, *device]
                + ["--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "20"]
                + ["--request-rate", "50", "200", "inf", "--max-concurrency", "8"]
                + ["--num-warmups", "2", "--result-dir", str(tmp_path), "--no-plot"]
                + ["--no-progress"]
            )
        # Warm-ups are not counted: 2 + 3 x 20 requests per label.
        assert server.requests() == 2 * 62
    a, b = sorted(tmp_path.glob("serve-*.json"))
    rec = json.loads(a.read_text())
    assert rec["environment"]["server_device"] == "NVIDIA H200"
    assert rec["environment"]["generator_cpu"]
    assert json.loads(b.read_text())["environment"]["server_device"] == "2 x NVIDIA H100 80GB HBM3"
    assert [r["request_rate"] for r in rec["rates"]] == [50, 200, "inf"]
    assert all(r["completed"] == 20 and r["failed"] == 0 for r in rec["rates"])
    assert all(r["total_input_tokens"] == 20 * 16 for r in rec["rates"])
    assert rec["rates"][0]["goodput"] is None  # no --slo
    assert all(r["generator_gc_full_collections"] >= 0 for r in rec["rates"])
    assert all(r["generator_gc_longest_pause_ms"] >= 0.0 for r in rec["rates"])
    # 20 Poisson arrivals at 50 req/s take about 0.4 s; at inf far less.
    assert rec["rates"][0]["duration_s"] > rec["rates"][2]["duration_s"]
    out = tmp_path / "both.png"
    assert pdserve_main(["bench", "plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_turn_sends_every_turn_with_the_reply_in_the_history():
    spec = MultiTurnSpec(users=3, turns=3, systems=2, system_tokens=10, output_tokens=4)
    spec.min_user_tokens = spec.max_user_tokens = 5
    w = MultiTurnWorkload.make(spec, vocab=1000, seed=1)
    dataset = Dataset(DatasetKind.MULTI_TURN, w.first_turns(), multi_turn=w)
    assert dataset.total_requests == 9

    async def go():
        with FakeServer() as server:
            backend = OpenAIBackend(server.base_url, SamplingOptions(want_token_ids=True))
            try:
                return await run_rate(backend, dataset, math.inf)
            finally:
                await backend.close()

    run = asyncio.run(go())
    assert len(run.results) == 9 and all(r.success for r in run.results)
    # Turn t's prompt: system 10 + t x (message 5 + reply 4) + message 5.
    assert sorted(r.prompt_len for r in run.results) == [15] * 3 + [24] * 3 + [33] * 3
    nxt = w.next_turn(BenchRequest([1, 2], 2, 4, conversation=0, turn=0), [7, 8])
    assert nxt.prompt == [1, 2, 7, 8, *w.messages[0][1]]
    assert w.next_turn(BenchRequest([], 0, 4, conversation=0, turn=2), []) is None


def test_a_rate_runs_with_the_generators_heap_frozen_and_counts_its_collections():
    """What is alive when a rate starts (here a heap of lists standing for the
    datasets and imports) is frozen out of the collector's walk while the rate
    runs, and unfrozen after, a failed rate included; full collections during
    the rate are counted in the result (one forced per finished request here)."""
    import gc

    heap = [[i] for i in range(1000)]
    marker = heap[500]

    def tracked() -> bool:  # gc.get_objects() leaves frozen objects out
        return any(o is marker for o in gc.get_objects())

    seen_during: list[bool] = []

    def on_done(_result):
        seen_during.append(tracked())
        gc.collect()  # a full collection in the middle of the rate

    dataset = Dataset(DatasetKind.RANDOM, [BenchRequest([1, 2, 3], 3, 2) for _ in range(3)])

    async def go(base_url: str, callback):
        backend = OpenAIBackend(base_url, SamplingOptions())
        try:
            return await run_rate(backend, dataset, 200.0, on_done=callback)
        finally:
            await backend.close()

    assert tracked()
    with FakeServer(Script(ttft_s=0.001, itl_s=0.001)) as server:
        run = asyncio.run(go(server.base_url, on_done))
    assert all(r.success for r in run.results)
    assert seen_during == [False, False, False]
    assert tracked()
    assert run.gc_full_collections >= 3  # the three forced ones, and any of its own

    def fail(_result):
        raise RuntimeError("a callback fails mid-rate")

    with FakeServer(Script(ttft_s=0.001, itl_s=0.001)) as server, pytest.raises(RuntimeError):
        asyncio.run(go(server.base_url, fail))
    assert tracked()  # unfrozen on the way out of a failed rate too


def test_arrivals_are_poisson_at_the_rate_and_burstiness_keeps_the_mean():
    for burstiness in (1.0, 0.25, 4.0):
        gaps = arrival_gaps(20.0, burstiness, seed=3)
        xs = [next(gaps) for _ in range(20000)]
        assert statistics.fmean(xs) == pytest.approx(1 / 20, rel=0.05)
        # Gamma(k): coefficient of variation 1 / sqrt(k); 1 for Poisson.
        cv = statistics.pstdev(xs) / statistics.fmean(xs)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert next(arrival_gaps(math.inf, 1.0, 0)) == 0.0


def test_slo_parsing_and_percentiles():
    assert parse_slo("ttft:500,tpot:50") == {SloMetric.TTFT: 0.5, SloMetric.TPOT: 0.05}
    for bad in ("ttft", "ttft:x", "foo:1", "tpot:-3"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert math.isnan(percentile([], 50))


def test_no_successes_exit_nonzero_and_are_all_listed(tmp_path):
    path = _jsonl(tmp_path, [{"prompt": "fail=1"}])
    with FakeServer() as server:
        code = pdserve_main(
            ["bench", "serve", "--base-url", server.base_url, "--dataset", "jsonl"]
            + ["--jsonl-path", str(path), "--num-prompts", "3", "--no-plot", "--no-progress"]
            + ["--result-dir", str(tmp_path)]
        )
    assert code == 1
    (r,) = json.loads(next(tmp_path.glob("serve-*.json")).read_text())["rates"]
    assert r["completed"] == 0 and r["failed"] == 3 and len(r["failures"]) == 3


def test_metrics_of_no_requests_are_nan_not_errors():
    m = compute([], 1.0, 1.0)
    assert m.completed == 0 and math.isnan(m.ttft_ms["p50"])


def test_each_rate_gets_its_own_prompts_so_no_rate_feeds_the_next_ones_cache():
    from pdserve.bench.cli import build_dataset
    from pdserve.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "serve", "--dataset", "shared-prefix", "--shared-prefix-groups", "2"]
        + ["--shared-prefix-prompts-per-group", "3", "--shared-prefix-system-len", "32"]
        + ["--shared-prefix-question-len", "8", "--vocab-size", "5000"]
    )
    a, b = build_dataset(args, 0), build_dataset(args, 1)
    assert len(a.requests) == len(b.requests) == 6
    assert {r.prompt_len for r in a.requests} == {40}
    # Within one dataset, prompts share one of two system prompts; across seeds none.
    systems = {tuple(r.prompt[:32]) for r in a.requests}
    assert len(systems) == 2 and not systems & {tuple(r.prompt[:32]) for r in b.requests}
    assert build_dataset(args, 0).requests[0].prompt == a.requests[0].prompt  # seeded


def test_arrival_seed_draws_the_gaps_apart_from_the_prompts(tmp_path, monkeypatch):
    """A second sweep on the same server takes other prompts (``--seed``) and, with
    ``--arrival-seed``, the first sweep's arrivals: the gaps run_rate draws."""
    import pdserve.bench.loadgen as loadgen

    seen = []
    real = loadgen.run_rate

    async def recording(backend, dataset, rate, burstiness, max_concurrency, seed, on_done):
        seen.append((seed, [r.prompt for r in dataset.requests]))
        return await real(backend, dataset, rate, burstiness, max_concurrency, seed, on_done)

    monkeypatch.setattr(loadgen, "run_rate", recording)
    with FakeServer(Script(ttft_s=0.001, itl_s=0.001)) as server:
        for extra in ([], ["--seed", "7", "--arrival-seed", "0"], ["--seed", "7"]):
            pdserve_main(
                ["bench", "serve", "--base-url", server.base_url, "--no-progress"]
                + ["--random-input-len", "8", "--random-output-len", "2", "--num-prompts", "4"]
                + ["--request-rate", "100", "--result-dir", str(tmp_path), "--no-plot", *extra]
            )
    (s0, p0), (s1, p1), (s2, p2) = seen
    assert (s0, s1, s2) == (0, 0, 7)
    assert p1 == p2 and p0 != p1  # prompts follow --seed alone


def test_the_side_by_side_summary_reads_either_servers_phase_histograms():
    from benchmarks.serve_summary import server_phases

    def s(count, mean, p90):
        bucket = [0.0, 300.0] if p90 < 300 else [300.0, 500.0]
        return {
            "count": count, "mean": mean, "p50": mean, "p90": p90, "unit": "ms",
            "p50_bucket": bucket, "p90_bucket": bucket,
        }  # fmt: skip

    vllm = {
        "server_histograms": {
            "http://v/metrics": {
                'vllm:request_queue_time_seconds{engine="0",model_name="dummy"}': s(96, 40, 90),
                'vllm:request_prefill_time_seconds{engine="0",model_name="dummy"}': s(96, 30, 60),
                'vllm:e2e_request_latency_seconds{engine="0",model_name="dummy"}': s(96, 900, 1e3),
            }
        }
    }
    assert server_phases(vllm) == {
        "queue_n": 96, "queue_mean_ms": 40, "queue_p90_ms": 90, "queue_p90_at_most_ms": 300,
        "prefill_n": 96, "prefill_mean_ms": 30, "prefill_p90_ms": 60,
        "prefill_p90_at_most_ms": 300,
    }  # fmt: skip
    # Two pdserve nodes: the one that computed most of the prompts speaks.
    pdserve = {
        "server_histograms": {
            "http://d/metrics": {
                'pdserve_request_prefill_time_seconds{node="d0",role="decode"}': s(90, 20, 50)
            },
            "http://p/metrics": {
                'pdserve_request_prefill_time_seconds{node="p0",role="prefill"}': s(6, 80, 99)
            },
        }
    }
    assert server_phases(pdserve) == {
        "prefill_n": 90, "prefill_mean_ms": 20, "prefill_p90_ms": 50, "prefill_p90_at_most_ms": 300
    }  # fmt: skip
    # A p90 past the last bucket has no bound (the record holds "inf" there).
    beyond = s(4, 900, 1e3) | {"p90_bucket": [500.0, "inf"]}
    open_ended = {"server_histograms": {"http://v": {"vllm:request_queue_time_seconds": beyond}}}
    assert server_phases(open_ended)["queue_p90_at_most_ms"] is None
    assert server_phases({}) is None
    assert server_phases({"server_histograms": {"http://x": {"error": "lost"}}}) is None


def test_interleaved_rounds_alternate_abba_with_one_prompt_seed_per_round(monkeypatch, tmp_path):
    """Both systems are started once; each round sweeps them in turn, pdserve
    first in rounds 0 and 3, vLLM first in 1 and 2; both get the round's seed,
    and pdserve's gRPC sweep keeps a seed of its own."""
    import argparse
    import contextlib

    from benchmarks import serve_side_by_side as sbs

    started, swept = [], []

    def up(name, sweeps):
        @contextlib.contextmanager
        def cm(args, out):
            started.append(name)
            yield sweeps

        return cm

    monkeypatch.setitem(sbs.UP, "vllm", up("vllm", [sbs.Sweep("vllm", ["v"])]))
    pd = [sbs.Sweep("pdserve-http", ["h"]), sbs.Sweep("pdserve-grpc", ["g"], seed=1000)]
    monkeypatch.setitem(sbs.UP, "pdserve", up("pdserve", pd))
    monkeypatch.setattr(
        sbs, "bench", lambda a, label, t, w, o, seed, probe: swept.append((w, label, seed))
    )
    args = argparse.Namespace(
        interleave=4,
        workloads=["shared-prefix"],
        out=tmp_path,
        systems=["pdserve", "vllm"],
        first="pdserve",
    )
    sbs.run_interleaved(args)
    assert started == ["vllm", "pdserve"]  # vLLM first: it refuses to start on less free memory
    firsts = [label for _, label, _ in swept[::3]]
    assert firsts == ["pdserve-http-r0", "vllm-r1", "vllm-r2", "pdserve-http-r3"]
    # A whole round, in order: pdserve's sweeps (HTTP, then gRPC on seeds of its own), then vLLM's.
    assert swept[:3] == [
        ("shared-prefix", "pdserve-http-r0", 0),
        ("shared-prefix", "pdserve-grpc-r0", 1000),
        ("shared-prefix", "vllm-r0", 0),
    ]
    assert swept[6:9] == [
        ("shared-prefix", "vllm-r2", 2 * sbs.ROUND_SEEDS),
        ("shared-prefix", "pdserve-http-r2", 2 * sbs.ROUND_SEEDS),
        ("shared-prefix", "pdserve-grpc-r2", 2 * sbs.ROUND_SEEDS + 1000),
    ]
    assert len(swept) == 12
    swept.clear()
    sbs.run_interleaved(argparse.Namespace(**{**vars(args), "first": "vllm"}))
    firsts = [label for _, label, _ in swept[::3]]
    assert firsts == ["vllm-r0", "pdserve-http-r1", "pdserve-http-r2", "vllm-r3"]
    # A sweep that fails stops both servers (the ExitStack unwinds them).
    stopped = []

    def up_logged(name):
        @contextlib.contextmanager
        def cm(args, out):
            try:
                yield [sbs.Sweep(name, [name])]
            finally:
                stopped.append(name)

        return cm

    def fails(*a):
        raise RuntimeError("sweep failed")

    monkeypatch.setitem(sbs.UP, "vllm", up_logged("vllm"))
    monkeypatch.setitem(sbs.UP, "pdserve", up_logged("pdserve"))
    monkeypatch.setattr(sbs, "bench", fails)
    with pytest.raises(RuntimeError, match="sweep failed"):
        sbs.run_interleaved(args)
    assert sorted(stopped) == ["pdserve", "vllm"]
    monkeypatch.setitem(sbs.UP, "vllm", up("vllm", [sbs.Sweep("vllm", ["v"])]))
    monkeypatch.setitem(sbs.UP, "pdserve", up("pdserve", pd))
    monkeypatch.setattr(
        sbs, "bench", lambda a, label, t, w, o, seed, probe: swept.append((w, label, seed))
    )
    # One system: its rounds are repeats on one server.
    started.clear(), swept.clear()
    sbs.run_interleaved(argparse.Namespace(**{**vars(args), "systems": ["pdserve"]}))
    assert started == ["pdserve"]
    assert [label for _, label, _ in swept[::2]] == [f"pdserve-http-r{r}" for r in range(4)]


def test_the_rounds_summary_pairs_each_round_with_vllms():
    from benchmarks.serve_summary import rounds_summary

    summary = {
        "shared_prefix_ttft_p50_ms": {
            "pdserve-http-r0": {"8": 18.0, "32": 25.0},
            "vllm-r0": {"8": 20.0, "32": 24.0},
            "pdserve-http-r1": {"8": 17.0, "32": 23.0},
            "vllm-r1": {"8": 19.0, "32": 26.0},
        },
        "random_max_goodput": {"pdserve-http-r0": 27.0, "vllm-r0": 26.0, "vllm-r1": 25.0},
    }
    out = rounds_summary(summary)
    ttft = out["shared_prefix_ttft_p50_ms_rounds"]
    assert ttft["per_system"]["vllm"]["32"] == {"rounds": [24.0, 26.0], "mean": 25.0}
    paired = ttft["paired"]["pdserve-http - vllm"]
    assert paired["8"] == {
        "rounds": [0, 1], "diffs": [-2.0, -2.0], "mean": -2.0, "rounds_at_or_ahead": "2 of 2"
    }  # fmt: skip
    assert paired["32"]["diffs"] == [1.0, -3.0] and paired["32"]["rounds_at_or_ahead"] == "1 of 2"
    # Goodput: more is ahead; only rounds both systems ran are paired.
    good = out["random_max_goodput_rounds"]["paired"]["pdserve-http - vllm"]["best"]
    assert good["diffs"] == [1.0] and good["rounds_at_or_ahead"] == "1 of 1"
    assert rounds_summary({"random_max_goodput": {"vllm": 26.0}}) == {}
    # Partial sweeps (stopped part-way): a rate is paired only in the rounds
    # both systems ran it; a rate only a later round has still counts.
    partial = rounds_summary(
        {
            "shared_prefix_ttft_p50_ms": {
                "pdserve-http-r0": {"8": 18.0},
                "vllm-r0": {"8": 20.0, "32": 24.0},
                "pdserve-http-r1": {"8": 17.0, "32": 23.0},
                "vllm-r1": {"8": 19.0},
            }
        }
    )["shared_prefix_ttft_p50_ms_rounds"]
    assert partial["per_system"]["pdserve-http"]["32"] == {"rounds": [23.0], "mean": 23.0}
    assert partial["paired"]["pdserve-http - vllm"]["8"]["diffs"] == [-2.0, -2.0]
    assert "32" not in partial["paired"]["pdserve-http - vllm"]  # never run by both in a round


def test_a_sweep_stopped_after_its_first_rate_keeps_that_rate_in_its_record(tmp_path, monkeypatch):
    """The record is written after every rate: a sweep that dies later (a
    timeout's kill, a server gone) leaves the rates it finished, marked
    incomplete; a whole sweep's record says complete."""
    import pdserve.bench.loadgen as loadgen

    real, calls = loadgen.run_rate, []

    async def dies_on_the_second_rate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the server went away")
        return await real(*args, **kwargs)

    argv = ["bench", "serve", "--random-input-len", "8", "--random-output-len", "2"]
    argv += ["--num-prompts", "4", "--result-dir", str(tmp_path), "--no-plot", "--no-progress"]
    with FakeServer(Script(ttft_s=0.001, itl_s=0.001)) as server:
        argv += ["--base-url", server.base_url, "--num-warmups", "0"]
        monkeypatch.setattr(loadgen, "run_rate", dies_on_the_second_rate)
        with pytest.raises(RuntimeError, match="went away"):
            pdserve_main([*argv, "--request-rate", "100", "200", "--label", "stopped"])
        monkeypatch.setattr(loadgen, "run_rate", real)
        whole_argv = [*argv, "--request-rate", "100", "200", "--label", "whole"]
        monkeypatch.setattr("sys.argv", ["pdserve", *whole_argv])
        pdserve_main(whole_argv)
    (stopped,) = tmp_path.glob("serve-stopped-*.json")
    rec = json.loads(stopped.read_text())
    assert rec["complete"] is False
    assert rec["timestamp"] in stopped.name  # every write keeps the sweep's stamp
    assert [r["request_rate"] for r in rec["rates"]] == [100]
    assert rec["rates"][0]["completed"] == 4
    (whole,) = tmp_path.glob("serve-whole-*.json")
    rec = json.loads(whole.read_text())
    assert rec["complete"] is True and [r["request_rate"] for r in rec["rates"]] == [100, 200]
    assert rec["command"].startswith("pdserve bench serve --random-input-len 8 ")
    assert not list(tmp_path.glob("*.part"))


def test_the_rounds_plot_draws_every_round_and_skips_records_without_one(tmp_path):
    from benchmarks.serve_summary import plot_rounds

    def rec(label, dataset, ttft):
        rates = [{"request_rate": r, "ttft_ms": {"p50": ttft + r}, "goodput": r} for r in (8, 16)]
        return {"label": label, "dataset": dataset, "rates": rates}

    recs = [rec(f"{s}-r{r}", "shared-prefix", t + r) for s, t in (("pdserve", 18), ("vllm", 21))
            for r in range(2)]  # fmt: skip
    from benchmarks.serve_summary import rounds_series

    # Every round's figure, per system and rate; a record without a round is not drawn.
    series = rounds_series([*recs, rec("vllm", "shared-prefix", 99)])
    assert series == {
        "shared-prefix": {
            "pdserve": {8: [26.0, 27.0], 16: [34.0, 35.0]},
            "vllm": {8: [29.0, 30.0], 16: [37.0, 38.0]},
        }
    }
    out = plot_rounds([*recs, rec("vllm-r0", "random", 0)], tmp_path / "r.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_rounds([rec("vllm", "shared-prefix", 21)], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_plot_rounds_draws_the_records_given_and_starts_no_server(tmp_path):
    """serve_side_by_side.py --plot-rounds: the rounds of interleaved records, read
    from their files, drawn into --out; nothing else runs."""
    from benchmarks import serve_side_by_side as sbs

    paths = []
    for label, ttft in (("pdserve-r0", 18.0), ("vllm-r0", 21.0)):
        rates = [{"request_rate": r, "ttft_ms": {"p50": ttft + r}, "goodput": r} for r in (8, 16)]
        path = tmp_path / f"serve-{label}.json"
        record = {"benchmark": "serve", "label": label, "dataset": "shared-prefix", "rates": rates}
        path.write_text(json.dumps(record))
        paths.append(str(path))
    out = tmp_path / "rounds.png"
    sbs.main(["--plot-rounds", *paths, "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(pathlib.Path(p).name for p in paths), "rounds.png"]
    )


def test_the_summary_lists_a_stopped_sweep_and_does_not_rank_its_best_goodput(tmp_path):
    from benchmarks.serve_summary import summarize

    def rate(r, goodput):
        return {
            "request_rate": r, "request_throughput": r, "goodput": goodput, "failed": 0,
            "ttft_ms": {"p50": 20.0, "p90": 30.0}, "tpot_ms": {"p50": 5.0, "p90": 6.0},
            "output_throughput": 100.0 * r, "output_tokens_per_s_per_user": 50.0,
        }  # fmt: skip

    for label, complete, rates in (("pdserve-http-r0", True, [(32, 26.0), (36, 27.0)]),
                                   ("vllm-r0", False, [(32, 26.5)])):  # fmt: skip
        record = {"benchmark": "serve", "label": label, "dataset": "random", "parameters": {}}
        record["environment"] = {"server_device": "NVIDIA H200"}
        record["complete"] = complete
        record["rates"] = [rate(r, g) for r, g in rates]
        (tmp_path / f"serve-{label}-random-20261127-120000.json").write_text(json.dumps(record))
    summary = summarize(tmp_path, ["random"], {})
    assert summary["random_incomplete_sweeps"] == ["vllm-r0"]
    assert summary["random_max_goodput"] == {"pdserve-http-r0": 27.0}
    assert summary["server_devices"] == ["NVIDIA H200"]
    assert (tmp_path / "plot-random.png").exists()
