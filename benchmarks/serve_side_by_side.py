"""pdserve against vLLM on one GPU, driven by `pdserve bench serve` over HTTP
(and pdserve over gRPC too: the HTTP edge's cost under load).

    PYTHONPATH=/tmp/vsite:$PWD python benchmarks/serve_side_by_side.py --out $OUT
    python benchmarks/serve_side_by_side.py --plot-rounds RECORD... --out rounds.png

One command for the whole GPU run (benchmarks/README.md says how to carry vLLM): dummy
weights of ``--shape`` (config only, engine/models/shapes.py), then for each
system in ``--systems`` (pdserve: one decode node that prefills locally, no
prefill node; vllm: `vllm serve` on the same config) start the server, poll
until it answers, sweep both workloads (random 1024 in / 128 out; shared
prefix 8 groups x 32 prompts, 2048-token system prompt, 128-token questions),
stop it; or, with ``--interleave ROUNDS``, both up at once on the GPU and
their sweeps alternated (the fairer comparison: no system always first, and
the same host state for both). Writes every record, one plot per workload
and summary.json (the issue's targets) under ``--out``. Each sweep and each
start has a timeout; the servers are killed on any exit. ``--plot-rounds``
only draws the rounds of interleaved runs' records, into ``--out`` (a PNG).

``pdserve-fp8`` and ``vllm-fp8`` in ``--systems`` are the same servers with FP8
weights (quantized at load) and an FP8 KV cache (``FP8_FLAGS``, the same flags
on a pdserve node and on `vllm serve`); their records' labels say so. Bf16
against FP8, same run, one system after the other:

    python benchmarks/serve_side_by_side.py --systems pdserve pdserve-fp8 vllm-fp8 \
        --workloads random --no-grpc

The host KV tier against none (``--workloads multi-turn``): every system's
KV pool made small on purpose, the same number of blocks on each (pdserve's
``--num-kvcache-blocks``, vLLM's ``--num-gpu-blocks-override``), so that the
conversations' KV is ``--working-set-ratio`` pools (benchmarks/support/kv_tier.py
computes it from the dataset and the shape's KV bytes a token);
``pdserve-host-tier`` is pdserve with ``--swap-space`` holding it all,
``vllm-offload`` vLLM with its OffloadingConnector of the same bytes. Before
the servers start, the host's plain copy rate into the GPU (a pinned copy,
CUDA events); after each pdserve system's sweeps, its node's host-tier
counters. The summary sets TTFT p50 / p90 and goodput with the tier against
without at each rate, and the tier's copy-in rate against the plain copy's:

    python benchmarks/serve_side_by_side.py --workloads multi-turn \
        --systems pdserve-host-tier pdserve vllm-offload vllm

pdserve's multi-turn sweeps go over HTTP, as vLLM's: each turn is made of the
last reply's token ids, which both return (vLLM's return_token_ids).

``--loras N``: both servers start with N random rank-16 LoRA adapters
(benchmarks/support/lora_adapters.py) and request i names the (i mod N)-th;
the base model's figures are a run without it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import triton_cache_entries
from benchmarks.serve_summary import plot_rounds, summarize
from benchmarks.support.kv_tier import (
    BLOCK_SIZE,
    GiB,
    WorkingSet,
    bench_args,
    copy_rate,
    parse_spec,
    tier_counters,
    write_json,
)
from engine.models.config import ModelArchConfig
from pdserve.redis_server import free_port

SLO = "ttft:500,tpot:50"
MAX_MODEL_LEN = 4096  # every server's
MAX_LEN = ["--max-model-len", str(MAX_MODEL_LEN)]
WORKLOADS = {
    "random": ["--dataset", "random", "--random-input-len", "1024", "--random-output-len", "128"],
    "shared-prefix": ["--dataset", "shared-prefix", "--shared-prefix-groups", "8"]
    + ["--shared-prefix-prompts-per-group", "32", "--shared-prefix-system-len", "2048"]
    + ["--shared-prefix-question-len", "128", "--random-output-len", "128"],
}

# FP8 weights quantized at load and an FP8 KV cache: a pdserve node's flags
# and `vllm serve`'s, the same names (vLLM's).
FP8_FLAGS = ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]

# multi-turn: conversations outgrowing a KV pool made small on purpose
# (benchmarks/support/kv_tier.py); its flags come from ``--multi-turn``.
MULTI_TURN = "multi-turn"

# Added to a sweep's prompt seed, apart enough that no seed of one workload
# (rounds x 10,000 + 1,000 + a rate's index) is another's.
WORKLOAD_SEEDS = {"random": 0, "shared-prefix": 5_000_000, MULTI_TURN: 10_000_000}
# A round's prompt seeds are round x ROUND_SEEDS, past any sweep's own (1,000).
ROUND_SEEDS = 10_000


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
    differ (the gRPC sweeps before 2026-11-27 had their own). Each workload
    adds its own offset (``WORKLOAD_SEEDS``): a random prompt of seed s is the
    start of shared-prefix group 0's system prompt of seed s, which a server
    that ran both would find cached (apart since 3445ded; the runs before
    had the same prompts for both systems, so the same head start)."""
    seed += WORKLOAD_SEEDS[workload]
    rates = args.rates[workload]
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--label", label, *target]
    cmd += [*args.workload_args[workload], "--num-prompts", str(args.num_prompts), "--ignore-eos"]
    cmd += ["--model-dir", str(args.model_dir), "--request-rate", *rates, "--slo", SLO]
    cmd += ["--num-warmups", "8", "--seed", str(seed), "--arrival-seed", "0"]
    cmd += ["--result-dir", str(out), "--no-progress"]
    cmd += ["--timeout", "120", *args.lora_bench_args]
    # Leave time to stop the servers and write the plots before the device's limit.
    timeout = min(args.sweep_timeout, args.deadline - time.monotonic() - 45)
    if timeout < 30:
        log(f"{label} {workload}: skipped, --time-budget spent")
        return
    log(f"{label} {workload}: rates {' '.join(rates)}")
    before = triton_cache_entries()
    from benchmarks.support.router_probe import Probe

    # router_probe.py: a client nothing else loads, beside the sweep.
    probe = Probe(*probe_at, 1024) if probe_at is not None else None
    records = set(out.glob(f"serve-{label}-{workload}-*.json"))
    with probe or contextlib.nullcontext():
        try:
            subprocess.run(cmd, check=False, timeout=timeout)
        except subprocess.TimeoutExpired:
            kept = "its record keeps the rates it finished"
            log(f"{label} {workload}: sweep timed out after {timeout:.0f} s ({kept})")
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


@dataclass(slots=True)
class Sweep:
    """One way to drive a running system: its record label, bench target
    arguments, prompt seed (each sweep on one server takes its own, or it would
    find an earlier sweep's prompts in the prefix cache) and probe address."""

    label: str
    target: list[str]
    seed: int = 0
    probe_at: tuple[str, int] | None = None


def pdserve_http(args, name: str) -> bool:
    """Whether pdserve gets an HTTP sweep: ``--http`` and a router that serves HTTP."""
    if not args.http:
        return False
    help_text = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "router", "--help"], capture_output=True, text=True
    ).stdout
    if "--http-port" not in help_text:
        log("pdserve's router has no --http-port yet: HTTP sweep skipped")
    return "--http-port" in help_text


@contextlib.contextmanager
def pdserve_up(
    args, out: Path, name: str = "pdserve", flags: tuple[str, ...] = (), host_tier: bool = False
) -> Iterator[list[Sweep]]:
    """pdserve, one decode node that prefills locally (with ``flags`` added to
    its engine's, and ``host_tier``: a host KV tier of ``args.host_tier_gib``);
    its HTTP and gRPC sweeps, labelled ``name``-http and -grpc. Once swept, the
    node's host-tier counters go to ``host-tier-NAME.json`` (all 0 without a
    tier): what the summary reads the tier's hits and copy-in rate from."""
    from pdserve.launcher import ClusterSpec, LocalCluster

    has_http = pdserve_http(args, name)
    http_port = free_port()
    engine = ["--load-format", "dummy", "--skip-tokenizer-init", *MAX_LEN]
    engine += [*args.pdserve_engine_args.split(), *flags, *args.lora_server_args]
    engine += [*args.pool_args["pdserve"], *(tier_args(args) if host_tier else [])]
    spec = ClusterSpec(
        model=str(args.model_dir),
        num_prefill=0,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        engine_args=engine,
        router_args=["--skip-tokenizer-init", "--no-remote-prefill", *MAX_LEN]
        + (["--http-port", str(http_port)] if has_http else []),
        start_timeout_s=args.start_timeout,
        log_dir=str(out / f"logs-{name}"),
    )
    log(f"starting {name} (1 decode node, local prefill): {' '.join(engine)}")
    with LocalCluster(spec) as cluster:
        (decode,) = [c for c in cluster.components if c.name.startswith("decode")]
        scrape = scrape_args(decode.metrics_url)
        sweeps = []
        if has_http:
            url = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{http_port}"]
            probe_at = (cluster.router_address, http_port) if args.probe else None
            sweeps.append(Sweep(f"{name}-http", url + scrape, probe_at=probe_at))
        if args.grpc:
            grpc = ["--backend", "grpc", "--address", cluster.router_address, *scrape]
            sweeps.append(Sweep(f"{name}-grpc", grpc, seed=1000))
        yield sweeps
        if decode.metrics_url is not None:
            counters = tier_counters(decode.metrics_url)
            write_json(out / f"host-tier-{name}.json", counters)
            log(f"{name}: host tier {counters}")


@contextlib.contextmanager
def vllm_up(
    args, out: Path, name: str = "vllm", flags: tuple[str, ...] = (), offload: bool = False
) -> Iterator[list[Sweep]]:
    """`vllm serve` on the same config (``flags`` added, and ``offload``: its
    CPU KV offloading, ``vllm_offload_args``), its process group stopped on
    any exit; its sweep labelled ``name``."""
    port = free_port()
    cmd = vllm_command(args, port, [*flags, *(vllm_offload_args(args) if offload else [])])
    (out / f"logs-{name}").mkdir(parents=True, exist_ok=True)
    logf = open(out / f"logs-{name}" / "server.log", "w")  # noqa: SIM115 - lives with the process
    log("starting vLLM: " + " ".join(cmd))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_USE_FLASHINFER_SAMPLER="0")
    proc = subprocess.Popen(
        cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", args.start_timeout, proc)
        target = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}"]
        target += ["--model", "dummy", *scrape_args(f"http://127.0.0.1:{port}/metrics")]
        yield [Sweep(name, target)]
    finally:
        # The whole process group: the API server and its engine core process.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        logf.close()


def vllm_command(args, port: int, flags: list[str]) -> list[str]:
    """`vllm serve`'s command line on the shape's config, ``flags`` added."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model_dir),
    ]
    cmd += ["--served-model-name", "dummy", "--load-format", "dummy", "--skip-tokenizer-init"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--port", str(port), "--host", "127.0.0.1"]
    cmd += [*args.vllm_args.split(), *args.pool_args["vllm"], *flags, *args.lora_server_args]
    return cmd


def tier_args(args) -> list[str]:
    """pdserve's host KV tier: ``--host-tier-gib``, else what holds the
    multi-turn working set."""
    if args.host_tier_gib is None:
        raise ValueError("a host-tier system needs --host-tier-gib or the multi-turn workload")
    return ["--swap-space", str(args.host_tier_gib)]


def vllm_offload_args(args) -> list[str]:
    """vLLM's CPU KV offloading of the same size as pdserve's host tier: its
    OffloadingConnector (CPU tier, LRU), in blocks of the pool's size."""
    gib = tier_args(args)[1]
    extra = {"cpu_bytes_to_use": int(float(gib) * GiB), "block_size": BLOCK_SIZE}
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    return ["--kv-transfer-config", json.dumps({**config, "kv_connector_extra_config": extra})]


UP = {
    "pdserve": pdserve_up,
    "pdserve-fp8": partial(pdserve_up, name="pdserve-fp8", flags=tuple(FP8_FLAGS)),
    "vllm": vllm_up,
    "vllm-fp8": partial(vllm_up, name="vllm-fp8", flags=tuple(FP8_FLAGS)),
    "pdserve-host-tier": partial(pdserve_up, name="pdserve-host-tier", host_tier=True),
    "vllm-offload": partial(vllm_up, name="vllm-offload", offload=True),
}


def lora_args(adapter_dirs: list[Path], rank: int) -> tuple[list[str], list[str]]:
    """(the servers' LoRA options, vLLM's names, which pdserve's nodes take
    too; the load generator's): every adapter loaded at start, in a device
    slot of its own, and named by the requests in turn."""
    n, names = len(adapter_dirs), [f"lora-{k}" for k in range(len(adapter_dirs))]
    server = ["--enable-lora", "--max-loras", str(n), "--max-cpu-loras", str(n)]
    server += ["--max-lora-rank", str(rank), "--lora-modules"]
    server += [f"{name}={d}" for name, d in zip(names, adapter_dirs, strict=True)]
    return server, ["--lora-modules", *names]


def size_multi_turn(args) -> None:
    """The multi-turn workload's flags, and every system's KV pool made
    ``--working-set-ratio`` times smaller than its conversations' KV (the same
    blocks of BLOCK_SIZE tokens on each); the sizes to ``working-set.json``."""
    if len(args.workloads) > 1:
        raise ValueError(
            f"{MULTI_TURN} makes every KV pool small on purpose: run it on its own "
            f"(--workloads {MULTI_TURN}), not with {args.workloads}"
        )
    spec = parse_spec(args.multi_turn)
    arch = ModelArchConfig.from_dir(args.model_dir)
    ws = WorkingSet.size(spec, arch, args.working_set_ratio, MAX_MODEL_LEN)
    args.workload_args[MULTI_TURN] = bench_args(spec)
    blocks, size = str(ws.pool_blocks), str(BLOCK_SIZE)
    args.pool_args = {
        "pdserve": ["--num-kvcache-blocks", blocks, "--kvcache-block-size", size],
        "vllm": ["--num-gpu-blocks-override", blocks, "--block-size", size],
    }
    if args.host_tier_gib is None:
        args.host_tier_gib = ws.host_tier_gib
    record = {"conversations": asdict(spec), **asdict(ws), "host_tier_gib_used": args.host_tier_gib}
    write_json(args.out / "working-set.json", record)
    log(
        f"{MULTI_TURN}: working set {ws.tokens} tokens ({ws.bytes / GiB:.2f} GiB) over a pool "
        f"of {ws.pool_blocks} blocks ({ws.pool_tokens} tokens): {ws.ratio}x; host tier "
        f"{args.host_tier_gib} GiB"
    )


def run_in_turn(args) -> None:
    """Each system in ``--systems`` started, swept and stopped in turn."""
    for system in args.systems:
        try:
            with UP[system](args, args.out) as sweeps:
                for workload in args.workloads:
                    for s in sweeps:
                        bench(args, s.label, s.target, workload, args.out, s.seed, s.probe_at)
        except Exception as e:  # the other system still runs; the error is in the log
            log(f"{system}: {type(e).__name__}: {e}")


def run_interleaved(args) -> None:
    """The systems in ``--systems`` up at once on the one GPU, each idle while
    another is swept, their sweeps alternated round by round (with two: ABBA
    BAAB...), so that neither system always runs first, on a colder host or a
    later one (each was faster in its second run of 2026-11-27, in turn). With
    one system, its rounds are repeats on one server. Round r's sweeps are
    labelled ``-rR`` and take prompt seed ROUND_SEEDS r (+ a sweep's own):
    every system gets the same prompts in a round, and a later round does not
    find an earlier one's prompts in its prefix cache. vLLM starts first, on
    ``--vllm-args``' share of the memory (vLLM refuses to start where less is
    free); pdserve's node subtracts what another process holds from its own
    budget (engine/model_runner.py)."""
    systems = sorted(set(args.systems), key=lambda s: not s.startswith("vllm"))
    with contextlib.ExitStack() as stack:
        up = {s: stack.enter_context(UP[s](args, args.out)) for s in systems}
        first = sorted(systems, key=lambda s: s != args.first)
        for r in range(args.interleave):
            order = first if r % 4 in (0, 3) else first[::-1]
            log(f"round {r}: {' then '.join(order)}")
            for workload in args.workloads:
                for system in order:
                    for s in up[system]:
                        label, seed = f"{s.label}-r{r}", s.seed + ROUND_SEEDS * r
                        bench(args, label, s.target, workload, args.out, seed, s.probe_at)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "serve-side-by-side")))
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument(
        "--systems",
        nargs="+",
        choices=list(UP),
        default=["pdserve", "vllm"],
        help="-fp8: FP8 weights and KV cache (FP8_FLAGS)",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=[*WORKLOADS, MULTI_TURN],
        default=list(WORKLOADS),
        help=f"{MULTI_TURN}: on its own (it sizes every system's KV pool to its conversations)",
    )
    p.add_argument("--random-rates", nargs="+", default=["4", "8", "16", "32", "64"])
    p.add_argument("--shared-prefix-rates", nargs="+", default=["8", "16", "32", "64"])
    p.add_argument("--multi-turn-rates", nargs="+", default=["2", "6"])
    p.add_argument(
        "--multi-turn",
        nargs="*",
        default=[],
        metavar="FIELD=N",
        help="the conversations (MultiTurnSpec's fields) over kv_tier.GPU_CONVERSATIONS, "
        "e.g. users=8 turns=3",
    )
    p.add_argument(
        "--working-set-ratio",
        type=float,
        default=3.5,
        help=f"{MULTI_TURN}: the conversations' KV over the pool every system gets",
    )
    p.add_argument(
        "--host-tier-gib",
        type=float,
        default=None,
        help="pdserve-host-tier's --swap-space and vllm-offload's CPU bytes (default: "
        f"what holds the {MULTI_TURN} working set)",
    )
    p.add_argument("--num-prompts", type=int, default=96, help="per rate (random)")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--sweep-timeout", type=float, default=400)
    p.add_argument(
        "--time-budget", type=float, default=580, help="seconds for everything (device limit 600)"
    )
    p.add_argument("--pdserve-engine-args", default="", help="e.g. '--attention-backend fa4'")
    p.add_argument(
        "--loras",
        type=int,
        default=0,
        metavar="N",
        help="both servers with N random rank-16 LoRA adapters, requests naming them in turn",
    )
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
    p.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="the --systems up at once on the GPU, their sweeps alternated for ROUNDS "
        "rounds (ABBA order; one system: ROUNDS sweeps on one server)",
    )
    p.add_argument(
        "--first",
        choices=list(UP),
        default="pdserve",
        help="with --interleave: the system that opens round 0",
    )
    p.add_argument(
        "--vllm-args",
        default=None,
        help="default: '--gpu-memory-utilization 0.9 --max-num-seqs 256' (0.42 with "
        "--interleave, which leaves pdserve a larger share than vLLM keeps for its KV cache)",
    )
    p.add_argument(
        "--plot-rounds",
        nargs="+",
        type=Path,
        metavar="RECORD",
        help="no run: draw these interleaved records' rounds into --out (a .png)",
    )
    # What --loras adds to both servers' and the load generator's command
    # lines (main fills them once the adapters exist).
    p.set_defaults(lora_server_args=[], lora_bench_args=[])
    # Each workload's flags, and the KV pool's on each server (the engines'
    # own sizes; multi-turn sets them, prepare()).
    p.set_defaults(workload_args=WORKLOADS, pool_args={"pdserve": [], "vllm": []})
    return p


def prepare(args) -> None:
    """What a run's servers and sweeps take from its arguments: the shape's
    config under ``--out``, each workload's rates and flags, vLLM's memory
    share, and (multi-turn) every system's KV pool and host tier."""
    from engine.models.shapes import write_shape_dir

    args.deadline = time.monotonic() + args.time_budget
    if args.vllm_args is None:
        share = 0.42 if args.interleave else 0.9
        args.vllm_args = f"--gpu-memory-utilization {share} --max-num-seqs 256"
    args.compiled = {}
    args.rates = {"random": args.random_rates, "shared-prefix": args.shared_prefix_rates}
    args.rates[MULTI_TURN] = args.multi_turn_rates
    args.workload_args = dict(WORKLOADS)
    args.out.mkdir(parents=True, exist_ok=True)
    args.model_dir = write_shape_dir(args.shape, args.out / "model")
    if MULTI_TURN in args.workloads:
        size_multi_turn(args)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.plot_rounds:
        from pdserve.bench.report import load_record

        print(plot_rounds([load_record(r) for r in args.plot_rounds], args.out))
        return
    prepare(args)
    if MULTI_TURN in args.workloads:
        # Before any server holds the GPU: what the tier's copy-in rate is set against.
        rate = copy_rate()
        write_json(args.out / "copy-rate.json", rate)
        log(f"host copy rate: {rate['bytes_per_s'] / 1e9:.2f} GB/s ({rate['how']})")
    # The adapters outside --out, whose files come back from the GPU host.
    with tempfile.TemporaryDirectory(prefix="lora-adapters-") as adapters:
        if args.loras:
            from benchmarks.support.lora_adapters import make_random_adapters

            dirs = make_random_adapters(args.model_dir, Path(adapters), args.loras)
            args.lora_server_args, args.lora_bench_args = lora_args(dirs, rank=16)
        # SIGTERM (a timeout) unwinds through the finally blocks that stop the servers.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        if args.interleave:
            try:
                run_interleaved(args)
            except Exception as e:  # the records so far are still summarised
                log(f"interleaved: {type(e).__name__}: {e}")
        else:
            run_in_turn(args)
    summarize(args.out, args.workloads, args.compiled)


if __name__ == "__main__":
    main()
