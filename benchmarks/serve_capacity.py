"""The load generator's own capacity: requests per second it schedules, sends
and measures on one core, against a fake OpenAI server that answers at once.

    python benchmarks/serve_capacity.py                       # 20,000 requests, rate inf
    python benchmarks/serve_capacity.py --num-prompts 50000 --output-len 4

The generator runs in this process pinned to one core (``--core``), the fake
server (benchmarks/serve_fake_server.py) in another process on the other cores.
Reported per rate: requests/s reached (wall clock), the generator's CPU seconds
and requests per CPU-second of it. When the generator's core is not saturated
(CPU share < 0.9), the fake server was the limit and the generator's capacity
is at least requests per CPU-second; that is the figure docs/performance.md
quotes. A second rate (``--request-rate 2000 inf`` by default) shows how late
Poisson arrivals left against their schedule at 2,000 req/s.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.event_loop import add_event_loop_argument
from common.runtime.event_loop import run as run_on_loop
from pdserve.redis_server import free_port

FAKE = Path(__file__).resolve().parent / "serve_fake_server.py"


def _wait_port(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError("the fake server did not start")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=20000)
    p.add_argument("--output-len", type=int, default=4, help="SSE chunks per request")
    p.add_argument("--request-rate", nargs="+", default=["2000", "inf"])
    p.add_argument("--max-concurrency", type=int, default=512)
    p.add_argument("--core", type=int, default=0, help="the generator's core")
    p.add_argument("--result-dir", type=Path, default=None)
    # The generator's loop (pdserve bench serve's --event-loop): an A/B of the two.
    add_event_loop_argument(p)
    args = p.parse_args(argv)

    cores = sorted(os.sched_getaffinity(0))
    others = [c for c in cores if c != args.core] or cores
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, str(FAKE), "--port", str(port)],
        preexec_fn=lambda: os.sched_setaffinity(0, others),
    )
    try:
        _wait_port(port)
        os.sched_setaffinity(0, {args.core})
        from pdserve.bench.cli import sweep
        from pdserve.cli import build_parser

        out = {}
        for rate in args.request_rate:
            bench = build_parser().parse_args(
                ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--label", "capacity"]
                + ["--random-input-len", "16", "--random-output-len", str(args.output_len)]
                + ["--num-prompts", str(args.num_prompts), "--request-rate", rate, "--no-plot"]
                + ["--max-concurrency", str(args.max_concurrency), "--no-progress"]
                + ["--event-loop", args.event_loop]
                + (["--result-dir", str(args.result_dir)] if args.result_dir else [])
            )
            cpu0, wall0 = time.process_time(), time.perf_counter()
            result = run_on_loop(lambda: sweep(bench), bench.event_loop)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            (m,) = result["rates"]
            out[rate] = {
                "requests_per_s": m.request_throughput,
                "failed": m.failed,
                "generator_cpu_s": cpu,
                "generator_cpu_share": cpu / wall,
                "requests_per_cpu_s": m.completed / cpu,
                "event_loop": bench.event_loop,
            }
            print(
                f"rate {rate}: {m.request_throughput:,.0f} req/s wall, generator CPU "
                f"{cpu / wall:.0%} of one core, {m.completed / cpu:,.0f} req per CPU-second, "
                f"{m.failed} failed",
                flush=True,
            )
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
