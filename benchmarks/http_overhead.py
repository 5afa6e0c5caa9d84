"""What the OpenAI HTTP edge adds to the gRPC path: TTFT and per-token p50, same cluster.

Starts a CPU cluster (1 prefill + 1 decode node, the demo model, a router with
--http-port), then sends the same greedy streamed request alternately through
gRPC Generate and POST /v1/completions (stream), one at a time, and reports the
client-side p50 of time to first token and of the gap between tokens. Writes a
JSON record (benchmarks/results/http_overhead-TIME.json) with both figures and
the edge's in-process CPU cost.

    python benchmarks/http_overhead.py --requests 200
    python benchmarks/http_overhead.py --edge-only       # the in-process cost alone
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from benchmarks.common import save_run
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto.client import generate

PROMPT = "The history of the printing press begins"


def grpc_once(address: str, channel, max_tokens: int) -> tuple[float, list[float]]:
    start = time.perf_counter()
    times = []
    for response in generate(
        address,
        PROMPT,
        channel=channel,  # one connection, as the HTTP side keeps one
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        timeout=60,
    ):
        if any(d.token_ids for d in response.deltas):
            times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)]


def http_once(conn: http.client.HTTPConnection, model: str, max_tokens: int):
    body = json.dumps(
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = conn.getresponse()
    times = []
    for line in reply:  # SSE: one "data: {...}" line per chunk
        if line.startswith(b"data: {") and b'"text":""' not in line:
            times.append(time.perf_counter())
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)]


def edge_cost(runs: int = 20000) -> dict[str, float]:
    """The HTTP edge's own CPU work, in-process (no network, no cluster): JSON body
    -> GenerateRequest, and one GenerateResponse -> one SSE event."""
    from types import SimpleNamespace

    from fastapi.sse import format_sse_event

    from proto import pdserve_pb2
    from router.http.chunks import Assembler
    from router.http.schemas import CompletionRequest

    body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 8, "stream": True}).encode()
    start = time.perf_counter()
    for _ in range(runs):
        CompletionRequest.model_validate_json(body).to_generate()
    parse_us = (time.perf_counter() - start) / runs * 1e6
    assembler = Assembler(SimpleNamespace(tokenizer=None), "cmpl", "m", 1, 1, chat=False)
    response = pdserve_pb2.GenerateResponse(
        deltas=[pdserve_pb2.Delta(text=" word", token_ids=[42])]
    )
    start = time.perf_counter()
    for _ in range(runs):
        for chunk in assembler.chunks(0, response):
            format_sse_event(data_str=json.dumps(chunk, separators=(",", ":")))
    chunk_us = (time.perf_counter() - start) / runs * 1e6
    # What the edge does now (router/http/chunks.py): the envelope encoded once.
    start = time.perf_counter()
    for _ in range(runs):
        assembler.events(0, response)
    events_us = (time.perf_counter() - start) / runs * 1e6
    print(
        f"edge CPU: request parse + conversion {parse_us:.1f} us, per-token SSE chunk "
        f"{events_us:.1f} us (as dicts, json.dumps and format_sse_event: {chunk_us:.1f} us)"
    )
    return {"parse_us": parse_us, "sse_chunk_us": events_us, "sse_chunk_as_dicts_us": chunk_us}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(Path("models/smollm2-135m-instruct")))
    p.add_argument("--requests", type=int, default=200, help="per path")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--edge-only", action="store_true", help="only the in-process edge cost")
    p.add_argument("--out-dir", type=Path, help="where the record goes (default results/)")
    args = p.parse_args(argv)
    results = {"edge_cpu": edge_cost()}
    if not args.edge_only:
        results |= cluster_paths(args)
    return save_run("http_overhead", args, results, argv)


def cluster_paths(args) -> dict:
    """TTFT and per-token p50 over gRPC and HTTP, alternating, on one CPU cluster."""
    spec = ClusterSpec(
        model=args.model,
        num_prefill=1,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        http_port=free_port(),
        engine_args=["--max-model-len", "1024"],
        start_timeout_s=300,
        metrics_port=0,
    )
    with LocalCluster(spec) as cluster:
        channel = grpc.insecure_channel(cluster.router_address)
        conn = http.client.HTTPConnection("127.0.0.1", cluster.http_ports[0], timeout=60)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
        ttft = {"grpc": [], "http": []}
        gaps = {"grpc": [], "http": []}
        for i in range(args.requests + 10):  # the first 10 pairs warm up
            for path in ("grpc", "http"):
                if path == "grpc":
                    first, between = grpc_once(cluster.router_address, channel, args.max_tokens)
                else:
                    first, between = http_once(conn, model, args.max_tokens)
                if i >= 10:
                    ttft[path].append(first)
                    gaps[path].extend(between)
    out = {}
    for path in ("grpc", "http"):
        out[path] = {
            "ttft_p50_ms": statistics.median(ttft[path]) * 1e3,
            "per_token_p50_ms": statistics.median(gaps[path]) * 1e3,
            "requests": len(ttft[path]),
        }
        print(
            f"{path:4s}: TTFT p50 {out[path]['ttft_p50_ms']:7.2f} ms, "
            f"per-token p50 {out[path]['per_token_p50_ms']:6.2f} ms ({len(ttft[path])} requests)"
        )
    out["http_minus_grpc_ttft_p50_ms"] = out["http"]["ttft_p50_ms"] - out["grpc"]["ttft_p50_ms"]
    print(f"HTTP adds {out['http_minus_grpc_ttft_p50_ms']:+.2f} ms to TTFT p50")
    return out


if __name__ == "__main__":
    main()
