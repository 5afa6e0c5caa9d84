"""pdserve against vLLM on one GPU, driven by `pdserve bench serve` over HTTP
(and pdserve over gRPC too: the HTTP edge's cost under load).

    PYTHONPATH=/tmp/vsite:$PWD python benchmarks/serve_side_by_side.py --out $OUT

One command for the whole GPU run (docs/performance.md, "Serving"): dummy
weights of ``--shape`` (config only, engine/models/shapes.py), then for each
system in ``--systems`` (pdserve: one decode node that prefills locally, no
prefill node; vllm: `vllm serve` on the same config) start the server, poll
until it answers, sweep both workloads (random 1024 in / 128 out; shared
prefix 8 groups x 32 prompts, 2048-token system prompt, 128-token questions),
stop it. Writes every record, one plot per workload and summary.json (the
issue's targets) under ``--out``. Each sweep and each start has a timeout; the
servers are killed on any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import triton_cache_entries
from pdserve.redis_server import free_port

SLO = "ttft:500,tpot:50"
WORKLOADS = {
    "random": ["--dataset", "random", "--random-input-len", "1024", "--random-output-len", "128"],
    "shared-prefix": ["--dataset", "shared-prefix", "--shared-prefix-groups", "8"]
    + ["--shared-prefix-prompts-per-group", "32", "--shared-prefix-system-len", "2048"]
    + ["--shared-prefix-question-len", "128", "--random-output-len", "128"],
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s")


def scrape_args(url: str | None) -> list[str]:
    """``--scrape-metrics URL`` where the server's /metrics answers (each rate's
    record then holds the server's queue and prefill time: vLLM's and a pdserve
    node's histograms); nothing where it does not, so a missing endpoint costs
    only that split, not the sweep."""
    if url is None:
        return []
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            if r.status == 200:
                return ["--scrape-metrics", url]
    except OSError as e:
        log(f"{url}: {e}; sweeping without the server's histograms")
    return []


def bench(
    args,
    label: str,
    target: list[str],
    workload: str,
    out: Path,
    seed: int = 0,
    probe_at: tuple[str, int] | None = None,
) -> None:
    """One sweep. ``seed``: the prompts' (each rate adds its index); a second
    sweep on the same cluster takes another, or it would find the first sweep's
    prompts in the prefix cache (the gRPC sweeps before 2026-11-25 did). The
    arrivals are seed 0's in every sweep: with 256 prompts a rate, another
    draw of Poisson gaps moves goodput near the knee by more than the systems
    differ (the gRPC sweeps before 2026-11-27 had their own)."""
    rates = args.rates[workload]
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--label", label, *target]
    cmd += [*WORKLOADS[workload], "--num-prompts", str(args.num_prompts), "--ignore-eos"]
    cmd += ["--model-dir", str(args.model_dir), "--request-rate", *rates, "--slo", SLO]
    cmd += ["--num-warmups", "8", "--seed", str(seed), "--arrival-seed", "0"]
    cmd += ["--result-dir", str(out), "--no-progress"]
    cmd += ["--timeout", "120"]
    # Leave time to stop the servers and write the plots before the device's limit.
    timeout = min(args.sweep_timeout, args.deadline - time.monotonic() - 45)
    if timeout < 30:
        log(f"{label} {workload}: skipped, --time-budget spent")
        return
    log(f"{label} {workload}: rates {' '.join(rates)}")
    before = triton_cache_entries()
    from benchmarks.router_probe import Probe

    # router_probe.py: a client nothing else loads, beside the sweep.
    probe = Probe(*probe_at, 1024) if probe_at is not None else None
    records = set(out.glob(f"serve-{label}-{workload}-*.json"))
    with probe or contextlib.nullcontext():
        try:
            subprocess.run(cmd, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{label} {workload}: sweep timed out after {timeout:.0f} s (record lost)")
    new = sorted(set(out.glob(f"serve-{label}-{workload}-*.json")) - records)
    if probe is not None and probe.samples is None:
        log(f"{label} {workload}: the probe failed (its error is above)")
    elif probe is not None and new:
        ran = sum(r["duration_s"] for r in json.loads(new[-1].read_text())["rates"])
        figures = probe.figures(ran)
        new[-1].with_name("probe-" + new[-1].name).write_text(
            json.dumps({"figures": figures, "samples": probe.samples}) + "\n"
        )
        log(f"{label} {workload}: probe while the rates ran: {figures}")
    # A kernel compiled while requests wait stalls the server for a second or so:
    # name what the sweep made a server compile (the first sweep on a fresh host).
    compiled = sorted(p.name for p in triton_cache_entries() - before)
    args.compiled[f"{label}-{workload}"] = compiled
    if compiled:
        log(f"{label} {workload}: {len(compiled)} Triton kernels compiled during the sweep")


def run_pdserve(args, out: Path) -> None:
    from pdserve.launcher import ClusterSpec, LocalCluster

    has_http = args.http and (
        "--http-port"
        in subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "router", "--help"],
            capture_output=True,
            text=True,
        ).stdout
    )
    http_port = free_port()
    engine = ["--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "4096"]
    engine += args.pdserve_engine_args.split()
    spec = ClusterSpec(
        model=str(args.model_dir),
        num_prefill=0,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        engine_args=engine,
        router_args=["--skip-tokenizer-init", "--no-remote-prefill", "--max-model-len", "4096"]
        + (["--http-port", str(http_port)] if has_http else []),
        start_timeout_s=args.start_timeout,
        log_dir=str(out / "logs-pdserve"),
    )
    log("starting pdserve (1 decode node, local prefill)")
    with LocalCluster(spec) as cluster:
        (decode,) = [c for c in cluster.components if c.name.startswith("decode")]
        scrape = scrape_args(decode.metrics_url)
        for workload in args.workloads:
            if has_http:
                url = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{http_port}"]
                url += scrape
                probe_at = (cluster.router_address, http_port) if args.probe else None
                bench(args, "pdserve-http", url, workload, out, probe_at=probe_at)
            else:
                log("pdserve's router has no --http-port yet: HTTP sweep skipped")
            if args.grpc:
                grpc = ["--backend", "grpc", "--address", cluster.router_address, *scrape]
                bench(args, "pdserve-grpc", grpc, workload, out, seed=1000)


def run_vllm(args, out: Path) -> None:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model_dir),
    ]
    cmd += ["--served-model-name", "dummy", "--load-format", "dummy", "--skip-tokenizer-init"]
    cmd += ["--max-model-len", "4096", "--port", str(port), "--host", "127.0.0.1"]
    cmd += args.vllm_args.split()
    (out / "logs-vllm").mkdir(parents=True, exist_ok=True)
    logf = open(out / "logs-vllm" / "server.log", "w")  # noqa: SIM115 - lives with the process
    log("starting vLLM: " + " ".join(cmd))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0")
    proc = subprocess.Popen(
        cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", args.start_timeout, proc)
        target = [
            "--backend",
            "openai",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--model",
            "dummy",
            *scrape_args(f"http://127.0.0.1:{port}/metrics"),
        ]
        for workload in args.workloads:
            bench(args, "vllm", target, workload, out)
    finally:
        # The whole process group: the API server and its engine core process.
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        logf.close()


GC_PAUSE = re.compile(r"garbage collection \(generation (\d)\) paused this process for (\d+) ms")
GC_FROZE = re.compile(r"froze (\d+) start-up objects")


def gc_pauses(log_dir: Path) -> dict:
    """Per pdserve process log: objects frozen at start-up and the collector's long
    pauses once serving (common/gc_heap.py logs each one over 50 ms; those of
    start-up, before the process says it is serving, are left out)."""
    found = {}
    for path in sorted(log_dir.glob("*.log")):
        text = path.read_text(errors="replace")
        serving = text.find(" serving on ")
        frozen = GC_FROZE.findall(text)
        text = text[serving:] if serving >= 0 else ""
        pauses = [int(ms) for _, ms in GC_PAUSE.findall(text)]
        found[path.stem] = {
            "frozen": int(frozen[-1]) if frozen else 0,
            "pauses_over_50ms": len(pauses),
            "max_pause_ms": max(pauses, default=0),
            "total_pause_ms": sum(pauses),
        }
    return found


def server_phases(rate: dict) -> dict[str, float] | None:
    """A rate's server-side queue and prefill time, mean and p90 in ms, from the
    histograms its record scraped (vLLM's ``vllm:request_*_time_seconds``, a
    pdserve node's ``pdserve_request_*_time_seconds``); None without them. With
    several series of a phase (nodes, labels): the one that observed the most.
    The p90 is an estimate within its bucket, whose upper bound comes with it
    (``*_p90_at_most_ms``, None past the last bucket): vLLM's first bucket is
    (0, 300 ms]."""
    out = {}
    for series in (rate.get("server_histograms") or {}).values():
        for key, s in series.items():
            for phase in ("queue", "prefill"):
                named = f"request_{phase}_time_seconds" in key.split("{")[0]
                if named and s["count"] > out.get(f"{phase}_n", 0):
                    out[f"{phase}_n"] = s["count"]
                    out[f"{phase}_mean_ms"] = s["mean"]
                    out[f"{phase}_p90_ms"] = s["p90"]
                    if "p90_bucket" in s:
                        # Past the last bucket there is no bound (a record writes inf as "inf").
                        upper = s["p90_bucket"][1]
                        bounded = isinstance(upper, (int, float)) and math.isfinite(upper)
                        out[f"{phase}_p90_at_most_ms"] = upper if bounded else None
    return out or None


def summarize(out: Path, workloads: list[str], compiled: dict[str, list[str]]) -> dict:
    """Plots per workload and the issue's two targets, from the records."""
    from pdserve.bench.plot import plot_records
    from pdserve.bench.report import load_record

    summary: dict = {}
    for workload in workloads:
        recs = [load_record(p) for p in sorted(out.glob(f"serve-*-{workload}-*.json"))]
        if not recs:
            continue
        plot_records(recs, out / f"plot-{workload}.png")
        per = {r["label"]: r["rates"] for r in recs}
        if workload == "random":
            summary["random_max_goodput"] = {
                k: max((x["goodput"] or 0.0) for x in v) for k, v in per.items()
            }
        else:
            summary["shared_prefix_ttft_p50_ms"] = {
                k: {str(x["request_rate"]): x["ttft_ms"]["p50"] for x in v} for k, v in per.items()
            }
        summary[f"{workload}_failed"] = {k: sum(x["failed"] for x in v) for k, v in per.items()}
        summary[f"{workload}_server_phases"] = {
            k: {str(x["request_rate"]): server_phases(x) for x in v} for k, v in per.items()
        }
    summary["triton_compiled_during_sweeps"] = compiled
    if (out / "logs-pdserve").is_dir():
        summary["pdserve_gc"] = gc_pauses(out / "logs-pdserve")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "serve-side-by-side")))
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--systems", nargs="+", choices=["pdserve", "vllm"], default=["pdserve", "vllm"])
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--random-rates", nargs="+", default=["4", "8", "16", "32", "64"])
    p.add_argument("--shared-prefix-rates", nargs="+", default=["8", "16", "32", "64"])
    p.add_argument("--num-prompts", type=int, default=96, help="per rate (random)")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--sweep-timeout", type=float, default=400)
    p.add_argument(
        "--time-budget", type=float, default=580, help="seconds for everything (device limit 600)"
    )
    p.add_argument("--pdserve-engine-args", default="", help="e.g. '--attention-backend fa4'")
    p.add_argument(
        "--http",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pdserve's HTTP sweep too (--no-http: gRPC only, where FastAPI is not installed)",
    )
    p.add_argument(
        "--grpc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pdserve's gRPC sweep too, on prompts of its own (--no-grpc: HTTP only)",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="beside pdserve's HTTP sweep, a client of its own times one-token requests "
        "over the router's HTTP and gRPC ports in turn (router_probe.py)",
    )
    p.add_argument("--vllm-args", default="--gpu-memory-utilization 0.9 --max-num-seqs 256")
    args = p.parse_args(argv)
    args.deadline = time.monotonic() + args.time_budget
    args.compiled = {}
    args.rates = {"random": args.random_rates, "shared-prefix": args.shared_prefix_rates}
    from engine.models.shapes import write_shape_dir

    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir = write_shape_dir(args.shape, args.out / "model")
    # SIGTERM (a timeout) unwinds through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for system in args.systems:
        try:
            (run_pdserve if system == "pdserve" else run_vllm)(args, args.out)
        except Exception as e:  # the other system still runs; the error is in the log
            log(f"{system}: {type(e).__name__}: {e}")
    summarize(args.out, args.workloads, args.compiled)


if __name__ == "__main__":
    main()
