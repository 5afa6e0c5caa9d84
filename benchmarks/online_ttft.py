"""Time to first token inside one engine under open-loop arrivals: where it goes.

    python benchmarks/online_ttft.py --shape llama-3.1-8b --request-rate 8 16
    python benchmarks/online_ttft.py --shape smollm2-135m --request-rate 2 --num-prompts 16  # CPU

The engine runs on an EngineThread and requests arrive from an asyncio loop on
a Poisson schedule, as on a decode node that prefills locally, but with no
gRPC, router or second process in the way. The workload is `pdserve bench
serve`'s shared-prefix dataset (G groups x P prompts sharing a system prompt,
ignore_eos). Each request's first token is split into

- handoff: the loop's submit to the engine thread adding it (command queue),
- queued: added to first scheduled (waiting for the step in flight to end),
- computed: first scheduled to its first token read on the host,
- delivered: read on the engine thread to seen on the loop,

with p50/p90 of each and of the whole, and TPOT. Comparing its TTFT with
`pdserve bench serve` on a cluster of the same shape and rate separates the
engine's share from the serving path's. ``--switch-interval-ms`` sets Python's
GIL switch interval in this process (the engine thread and the loop share one
GIL, as on a node).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run, summary_ms
from engine.models.shapes import SHAPES, write_shape_dir
from pdserve.bench.datasets import shared_prefix_requests


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--request-rate", type=float, nargs="+", default=[8.0])
    p.add_argument("--num-prompts", type=int, default=128, help="per rate")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=32)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--switch-interval-ms", type=float, help="sys.setswitchinterval for this run")
    p.add_argument("--out-dir", type=Path)
    return p.parse_args(argv)


async def one(thread, rid: str, prompt: list[int], params, rec: dict[str, float]) -> None:
    from engine.request_stream import RequestStream

    stream = RequestStream()
    rec["submit"] = time.monotonic()

    def add(engine) -> None:
        rec["added"] = time.monotonic()
        engine.add_request(rid, prompt, params, arrival_time=rec["added"])

    await asyncio.wrap_future(thread.add(rid, stream.sink, add))
    rec["tokens"] = 0
    async for out in stream:
        new = len(out.outputs[0].token_ids) if out.outputs else 0  # DELTA: the new ones
        rec["tokens"] += new
        if "seen" not in rec and new:
            rec["seen"] = time.monotonic()
            m = out.metrics
            rec["scheduled"], rec["first_token"] = m.first_scheduled_time, m.first_token_time
        if out.finished:
            rec["end"] = time.monotonic()


async def sweep_rate(thread, requests, params_for, rate: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    records: list[dict[str, float]] = [{} for _ in requests]
    tasks = []
    for i, r in enumerate(requests):
        tasks.append(
            asyncio.create_task(one(thread, f"r{rate}-{i}", r.prompt, params_for(r), records[i]))
        )
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return records


def summarize(records: list[dict[str, float]]) -> dict[str, Any]:
    def ms(a: str, b: str) -> list[float]:
        return [(r[b] - r[a]) * 1e3 for r in records]

    tpot = [(r["end"] - r["seen"]) * 1e3 / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    return {
        "ttft_ms": summary_ms(ms("submit", "seen")),
        "handoff_ms": summary_ms(ms("submit", "added")),
        "queued_ms": summary_ms(ms("added", "scheduled")),
        "computed_ms": summary_ms(ms("scheduled", "first_token")),
        "delivered_ms": summary_ms(ms("first_token", "seen")),
        "tpot_ms": summary_ms(tpot),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from engine import LLM, SamplingParams
    from engine.engine_thread import EngineThread
    from engine.sampling_params import RequestOutputKind

    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    results: dict[str, Any] = {"switch_interval_ms": sys.getswitchinterval() * 1e3, "rates": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_dir(args.shape, tmp)
        llm = LLM(
            str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            device=device,
            attention_backend=args.attention_backend,
            max_model_len=args.max_model_len,
            seed=args.seed,
            async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        )
        engine = llm.llm_engine
        results["async_scheduling"] = engine.async_scheduling
        vocab = SHAPES[args.shape]["vocab_size"]

        def params_for(r):
            return SamplingParams(
                max_tokens=r.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )

        thread = EngineThread(engine).start()
        try:
            for k, rate in enumerate(args.request_rate):
                reqs = shared_prefix_requests(
                    args.groups,
                    args.prompts_per_group,
                    args.system_len,
                    args.question_len,
                    args.output_len,
                    vocab,
                    args.seed + k,
                )[: args.num_prompts]
                # Warm-up: one request per group puts every system prompt in the
                # prefix cache (the serving runs' warm-up requests do the same).
                warm = [r for i, r in enumerate(reqs) if i < args.groups]
                asyncio.run(sweep_rate(thread, warm, params_for, 1e6, args.seed))
                records = asyncio.run(sweep_rate(thread, reqs, params_for, rate, args.seed))
                row = {"request_rate": rate, "num_prompts": len(records), **summarize(records)}
                results["rates"].append(row)
                print(
                    f"rate {rate:g}: TTFT p50 {row['ttft_ms']['p50_ms']:.1f} ms"
                    f" = handoff {row['handoff_ms']['p50_ms']:.1f} + queued {row['queued_ms']['p50_ms']:.1f}"
                    f" + computed {row['computed_ms']['p50_ms']:.1f}"
                    f" + delivered {row['delivered_ms']['p50_ms']:.1f} (p50s);"
                    f" TTFT p90 {row['ttft_ms']['p90_ms']:.1f}; TPOT p50 {row['tpot_ms']['p50_ms']:.2f} ms",
                    flush=True,
                )
        finally:
            thread.stop()
    save_run("online_ttft", args, results, argv)
    return results


if __name__ == "__main__":
    main()
