"""A probe beside a load: one-token requests over a router's HTTP port (a bare
client) and its gRPC port in turn, from a process that nothing else loads, so
that what it times is the router's edge under the load and not the load
generator's own client. ``router_relay.py --probe`` and ``serve_side_by_side.py
--probe`` run it beside their sweeps (``Probe``):

    python benchmarks/support/router_probe.py ADDRESS HTTP_PORT [--input-len N]

runs until SIGTERM, then prints its samples as JSON on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.http_first_token import RawHttp

# The probe: a pause this long after each of its requests, few enough
# that it adds little load; no request waits longer than PROBE_REQUEST_S; it
# is given PROBE_STOP_S to print its samples once told to stop.
PROBE_GAP_S = 0.1
PROBE_REQUEST_S = 30.0
PROBE_STOP_S = 60.0


class Probe:
    """``probe_run`` in a process of its own while a ``with`` block runs (a
    sweep): on the way out it is stopped and its samples read (``samples`` is
    None when it failed or would not stop; its error is on stderr)."""

    def __init__(self, address: str, http_port: int, input_len: int) -> None:
        self.command = [sys.executable, __file__, address, str(http_port)]
        self.command += ["--input-len", str(input_len)]
        self.samples: dict | None = None
        self.ended = 0.0

    def __enter__(self) -> Probe:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE)
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.time()
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=PROBE_STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return
        with contextlib.suppress(ValueError):  # it died before printing
            self.samples = json.loads(out)

    def figures(self, ran_s: float) -> dict:
        """``probe_figures`` over the last ``ran_s`` seconds of the block (the
        sweep's rates: a sweep exits as soon as its last rate ends)."""
        return probe_figures(self.samples, (self.ended - ran_s, self.ended))


def probe_figures(samples: dict, window: tuple[float, float]) -> dict:
    """TTFT mean and p50 per path of the probe's requests that started inside
    ``window`` (wall-clock seconds): those before the load began or after it
    ended are left out."""
    lo, hi = window
    row: dict = {"probe_failed": sum(lo <= t <= hi for t in samples["failed"])}
    for path in ("http", "grpc"):
        times = [s for t, s in samples[path] if lo <= t <= hi]
        row[f"probe_{path}_n"] = len(times)
        if times:
            row[f"probe_{path}_ttft_mean_ms"] = statistics.fmean(times) * 1e3
            row[f"probe_{path}_ttft_p50_ms"] = statistics.median(times) * 1e3
    if row["probe_http_n"] and row["probe_grpc_n"]:
        row["probe_http_minus_grpc_mean_ms"] = (
            row["probe_http_ttft_mean_ms"] - row["probe_grpc_ttft_mean_ms"]
        )
    return row


async def probe_run(address: str, http_port: int, input_len: int) -> dict:
    """Until SIGTERM: one-token requests over the router's gRPC port and its HTTP
    port (a bare client) in turn, PROBE_GAP_S apart (a pause after each); their
    times to the first token, from a client that nothing else loads, as
    {"http": [[wall-clock start, seconds], ...], "grpc": [...], "failed": [start, ...]}."""
    import grpc

    from proto import pdserve_pb2, pdserve_pb2_grpc

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    prompt = list(range(1, input_len + 1))
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True})
    raw = RawHttp(http_port, body.encode())
    request = pdserve_pb2.GenerateRequest(
        sampling=pdserve_pb2.SamplingParams(max_tokens=1, temperature=0.0)
    )
    request.token_ids.ids.extend(prompt)
    samples: dict = {"http": [], "grpc": [], "failed": []}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pdserve_pb2_grpc.RouterStub(channel)

        async def via_grpc() -> float:
            start = time.perf_counter()
            async for _ in stub.Generate(request):
                return time.perf_counter() - start
            raise RuntimeError("no response")

        paths = {"http": raw.first_event, "grpc": via_grpc}
        i = 0
        while not stop.is_set():
            label = ("http", "grpc")[i % 2]
            i += 1
            started = time.time()
            try:
                seconds = await asyncio.wait_for(paths[label](), PROBE_REQUEST_S)
            except Exception:  # a refusal, a reset, a timeout: counted, the probe goes on
                seconds = None
            if seconds is None:
                samples["failed"].append(started)
                if label == "http":  # its connection may be in any state now: a new one
                    raw.close()
                    raw = RawHttp(http_port, body.encode())
            else:
                samples[label].append([started, seconds])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_GAP_S)
    raw.close()
    return samples


def probe_line(row: dict) -> str:
    """``probe_figures``' result in a sentence."""
    return (
        f"probe ({row['probe_http_n']} HTTP and {row['probe_grpc_n']} gRPC one-token "
        f"requests while the rate ran, {row['probe_failed']} failed): TTFT mean over HTTP "
        f"{row['probe_http_ttft_mean_ms']:.2f} ms, over gRPC {row['probe_grpc_ttft_mean_ms']:.2f} "
        f"ms, HTTP minus gRPC {row['probe_http_minus_grpc_mean_ms']:+.2f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("address", help="the router's gRPC address (host:port)")
    p.add_argument("http_port", type=int, help="the router's OpenAI HTTP port on 127.0.0.1")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    args = p.parse_args()
    print(json.dumps(asyncio.run(probe_run(args.address, args.http_port, args.input_len))))


if __name__ == "__main__":
    main()
