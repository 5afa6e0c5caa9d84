"""The router alone under load: its CPU per request and per streamed token, both encodings.

    python benchmarks/router_relay.py                  # gRPC and HTTP, a few thousand streams
    python benchmarks/router_relay.py --ttft-only      # TTFT added by the router at low load

Real processes: Redis, the router (`pdserve router`, with its OpenAI HTTP port)
and a fake decode node: a real gRPC server in its own process serving the
internal DecodeNode API and registered in Redis like a node, which answers
every request at once with ``--output-len`` messages of one token each (what
a decode node sends, one message per engine step) and no model behind it. The
model is out of the picture, so what is measured is the router's own work:

- load: `pdserve bench serve` streams ``--num-prompts`` requests at
  ``--max-concurrency``, once over gRPC and once over HTTP (/v1/completions,
  stream); the router's CPU seconds (user + system, from /proc) during each
  sweep, divided by the requests and by the tokens streamed. The inverse is the
  token rate one router core sustains.
- ttft: sequential one-token requests, alternately through the router and
  straight to the fake node (on a DecodeSession of this process, as the router
  sends them); the p50 difference is what the router
  and its extra hop add to a request's time to first token. With HTTP among
  ``--encodings`` the same request also goes to the router's OpenAI port,
  streamed, from a bare HTTP/1.1 client (the server's side of the HTTP edge)
  and from aiohttp (what `pdserve bench serve` adds on the client's side).
  With ``--compare-tree DIR`` a second router runs from another checkout (the
  baseline, say) beside the first, on the same fake node, and the requests
  rotate among the three, so that both routers are measured under the same
  load: on a shared machine that matters more than anything measured.

A JSON record goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import command_line, environment, write_record
from benchmarks.fake_decode_node import fake_node, wait_routable
from benchmarks.http_first_token import HttpPaths
from benchmarks.support.router_probe import Probe, probe_line
from pdserve.redis_server import RedisServer, free_port


# ---------------------------------------------------------------- measurement
def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sweep(
    args,
    router_pid: int,
    node_pid: int,
    target: list[str],
    label: str,
    out: Path,
    probe_at: tuple[str, int] | None = None,
) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--label", label, *target]
    cmd += ["--dataset", "random", "--random-input-len", str(args.input_len)]
    cmd += ["--random-output-len", str(args.output_len), "--ignore-eos"]
    cmd += ["--vocab-size", "1000", "--num-prompts", str(args.num_prompts)]
    cmd += ["--max-concurrency", str(args.max_concurrency), "--request-rate", args.request_rate]
    cmd += ["--result-dir", str(out), "--no-plot", "--no-progress", "--num-warmups", "16"]
    before = set(out.glob("*.json"))
    probe = Probe(*probe_at, args.input_len) if probe_at is not None else None
    cpu0, node0 = cpu_seconds(router_pid), cpu_seconds(node_pid)
    with probe or contextlib.nullcontext():
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    cpu = cpu_seconds(router_pid) - cpu0
    node_cpu = cpu_seconds(node_pid) - node0
    (path,) = set(out.glob("*.json")) - before
    (rate,) = json.loads(path.read_text())["rates"]
    if rate["failed"]:
        raise RuntimeError(f"{label}: {rate['failed']} requests failed: {rate['errors']}")
    tokens = rate["total_output_tokens"]
    # Warm-up requests ran inside the CPU window too: count their tokens.
    requests = rate["completed"] + 16
    tokens += 16 * args.output_len
    row = {
        "encoding": label,
        "requests": requests,
        "tokens": tokens,
        "router_cpu_s": cpu,
        "router_cpu_us_per_token": cpu / tokens * 1e6,
        "router_cpu_us_per_request": cpu / requests * 1e6,
        "tokens_per_router_cpu_second": tokens / cpu,
        "wall_output_tok_per_s": rate["output_throughput"],
        # The fake node: a bare gRPC server streaming the same messages, for scale.
        "fake_node_cpu_us_per_token": node_cpu / tokens * 1e6,
        # With --token-interval-ms and a --request-rate: the client's first-token
        # wait under that load, router's event loop busy with the other streams.
        "ttft_mean_ms": rate["ttft_ms"]["mean"],
        "ttft_p50_ms": rate["ttft_ms"]["p50"],
        "ttft_p90_ms": rate["ttft_ms"]["p90"],
    }
    if probe is not None and probe.samples is not None:  # the CPU above includes the
        # probe's requests, which ran through the router too
        row |= probe.figures(rate["duration_s"])
        row["router_cpu_includes_probe"] = True
    print(
        f"{label:5s}: {requests} streams x {args.output_len} tokens; router CPU {cpu:.2f} s = "
        f"{row['router_cpu_us_per_token']:.1f} us/token, {row['router_cpu_us_per_request']:.0f} "
        f"us/request -> {row['tokens_per_router_cpu_second']:,.0f} tokens per router CPU-second "
        f"(wall {rate['output_throughput']:,.0f} tok/s); the fake node (a bare gRPC stream) "
        f"{row['fake_node_cpu_us_per_token']:.1f} us/token; TTFT mean {row['ttft_mean_ms']:.2f} ms, "
        f"p50 {row['ttft_p50_ms']:.2f} ms, "
        f"p90 {row['ttft_p90_ms']:.2f} ms",
        flush=True,
    )
    if "probe_http_minus_grpc_mean_ms" in row:
        print(f"{label:5s}: {probe_line(row)}", flush=True)
    return row


async def ttft(
    args, routers: dict[str, str], node_address: str, http_port: int | None = None
) -> dict:
    """``routers``: label -> address (the router, and the one from --compare-tree);
    ``http_port``: the first router's OpenAI port, measured too (raw, aiohttp and the
    load generator's client)."""
    import grpc

    from proto import internal_pb2, pdserve_pb2, pdserve_pb2_grpc
    from router.node_session import NodeSession

    prompt = list(range(1, args.input_len + 1))
    sampling = pdserve_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    channels = {label: grpc.aio.insecure_channel(a) for label, a in routers.items()}
    async with grpc.aio.insecure_channel(node_address) as nc:
        stubs = {label: pdserve_pb2_grpc.RouterStub(c) for label, c in channels.items()}
        node = NodeSession(nc, "fake-decode")  # what the router sends on, from here

        async def via_router(label: str) -> float:
            start = time.perf_counter()
            request = pdserve_pb2.GenerateRequest(sampling=sampling)
            request.token_ids.ids.extend(prompt)
            async for _ in stubs[label].Generate(request):
                return time.perf_counter() - start
            raise RuntimeError("no response")

        async def direct(i: int) -> float:
            start = time.perf_counter()
            command = internal_pb2.SessionCommand()
            command.start.request.request_id = f"d{i}"
            command.start.request.prompt_token_ids.extend(prompt)
            command.start.request.sampling.CopyFrom(sampling)
            call = await node.start(command, None)
            if await call.read() is grpc.aio.EOF:
                raise RuntimeError("no response")
            elapsed = time.perf_counter() - start
            call.cancel()
            return elapsed

        paths = {label: (lambda label=label: via_router(label)) for label in routers}
        if http_port is not None:
            http = HttpPaths(http_port, prompt)
            paths.update(http.paths)
        labels = [*paths]
        for i in range(20):  # warm every path (channels, caches)
            for label in labels:
                await paths[label]()
            await direct(i)
        r: dict[str, list[float]] = {label: [] for label in labels}
        d = []
        for i in range(args.ttft_requests):
            # Rotate the order too: no path always runs right after another.
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                r[label].append(await paths[label]())
            d.append(await direct(i))
        if http_port is not None:
            await http.close()
    for c in channels.values():
        await c.close()
    row = {
        "requests": args.ttft_requests,
        "prompt_tokens": args.input_len,
        "direct_ttft_p50_ms": statistics.median(d) * 1e3,
    }
    for label, times in r.items():
        key = "router" if label == "router" else label.replace("-", "_")
        row[f"{key}_ttft_p50_ms"] = statistics.median(times) * 1e3
        row[f"{key}_added_p50_ms"] = row[f"{key}_ttft_p50_ms"] - row["direct_ttft_p50_ms"]
        print(
            f"TTFT p50 over {args.ttft_requests} one-token requests of {args.input_len} prompt "
            f"tokens: through {label} {row[f'{key}_ttft_p50_ms']:.3f} ms, straight to the node "
            f"{row['direct_ttft_p50_ms']:.3f} ms: {label} adds {row[f'{key}_added_p50_ms']:.3f} ms",
            flush=True,
        )
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument(
        "--request-rate", default="inf", help="the load's requests/s (inf: back to back)"
    )
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=300)
    p.add_argument("--ttft-only", action="store_true")
    p.add_argument("--encodings", default="grpc,http")
    p.add_argument("--out-dir", type=Path)
    p.add_argument(
        "--compare-tree",
        type=Path,
        help="another checkout whose router runs beside this one's in the TTFT part",
    )
    p.add_argument(
        "--token-interval-ms",
        type=float,
        default=0.0,
        help="the fake node's time between a stream's tokens (0: as fast as it can)",
    )
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="the fake node sends all streams' tokens on one tick, as an engine step does",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="beside each load sweep, router_probe.py (needs http among --encodings)",
    )
    p.add_argument("--fake-node", nargs=5, metavar=("REDIS", "PORT", "MODEL_ID", "BLOCK", "MS"))
    args = p.parse_args(argv)
    if args.probe and "http" not in args.encodings.split(","):
        p.error("--probe needs http among --encodings (it times the router's HTTP port)")
    if args.fake_node:
        url, port, model_id, block, ms = args.fake_node
        asyncio.run(fake_node(url, int(port), model_id, int(block), float(ms) / 1e3, args.lockstep))
        return {}
    from engine.models.shapes import write_shape_dir

    compare = str(args.compare_tree) if args.compare_tree else None
    results: dict = {"parameters": vars(args) | {"out_dir": None, "compare_tree": compare}}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis:
        model_dir = write_shape_dir("smollm2-135m", Path(tmp) / "model")
        node_port, port, http = free_port(), free_port(), free_port()
        try:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--fake-node", redis.url, str(node_port)]
                    + [model_dir.name, "16", str(args.token_interval_ms)]
                    + ["--lockstep"] * args.lockstep
                )
            )

            def router_cmd(port: int, http: list[str]) -> list[str]:
                cmd = [sys.executable, "-m", "pdserve.cli", "router", "--model", str(model_dir)]
                cmd += ["--redis-url", redis.url, "--port", str(port), "--host", "127.0.0.1"]
                cmd += ["--admin-port", str(free_port()), *http]
                return cmd + ["--skip-tokenizer-init", "--no-access-log", "--metrics-port", "0"]

            # The HTTP port only for the HTTP sweep (the TTFT part is gRPC, and needs no FastAPI).
            serve_http = "http" in args.encodings.split(",")
            router = subprocess.Popen(router_cmd(port, ["--http-port", str(http)] * serve_http))
            procs.append(router)
            address = f"127.0.0.1:{port}"
            routers = {"router": address}
            if args.compare_tree:
                # Its own packages first on the path (not this checkout's installation).
                other = free_port()
                path = [str(args.compare_tree.resolve()), os.environ.get("PYTHONPATH", "")]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
                cmd = router_cmd(other, [])
                procs.append(subprocess.Popen(cmd, cwd=args.compare_tree, env=env))
                routers["compare-tree"] = f"127.0.0.1:{other}"
            for a in routers.values():
                wait_routable(a)
            results["ttft"] = asyncio.run(
                ttft(args, routers, f"127.0.0.1:{node_port}", http if serve_http else None)
            )
            if not args.ttft_only:
                sweeps = []
                out = Path(tmp) / "records"
                out.mkdir()
                for enc in args.encodings.split(","):
                    target = (
                        ["--backend", "grpc", "--address", address]
                        if enc == "grpc"
                        else ["--backend", "openai", "--base-url", f"http://127.0.0.1:{http}"]
                    )
                    probe_at = (address, http) if args.probe else None
                    sweeps.append(sweep(args, router.pid, procs[0].pid, target, enc, out, probe_at))
                results["load"] = sweeps
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    record = {"environment": environment(), "results": results}
    path, _ = write_record(
        "router_relay", record, command_line("router_relay.py", argv), args.out_dir
    )
    print(f"record: {path}")
    return results


if __name__ == "__main__":
    main()
