"""Issue #16's GPU figures in one call: async scheduling on and off.

    python benchmarks/async_sched_gpu.py            # about 5 minutes on one H200
    python benchmarks/async_sched_gpu.py --peer vllm  # also vLLM per shape (carried: docs/performance.md)

Prints one table: offline throughput (the nano-vllm workload of
offline_throughput.py) for the Qwen3-0.6B and Llama-3.1-8B shapes with async
scheduling on and off, the engine's batch-1 decode (one 128-token prompt, 512
output tokens: ms per output token, host work included), and model_step.py's
batch-1 decode step (GPU time of forward + logits + sampling). Each run is its
own process, so one's memory never sizes the next one's KV cache; the JSON
records stay in --out-dir.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("qwen3-0.6b", "llama-3.1-8b")
BATCH1 = ["--num-seqs", "1", "--min-input-len", "128", "--max-input-len", "128"]
BATCH1 += ["--min-output-len", "512", "--max-output-len", "512"]


def run(script: str, argv: list[str], out_dir: Path) -> dict:
    before = set(out_dir.glob("*.json"))
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *argv, "--out-dir", str(out_dir)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    (new,) = set(out_dir.glob("*.json")) - before
    return json.loads(new.read_text())["results"]


def main(argv: list[str] | None = None) -> list[tuple[str, ...]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peer", choices=["vllm"])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="async-sched-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, ...]] = []
    for shape in args.shapes.split(","):
        for mode in ("off", "on"):
            extra = ["--peer", args.peer] if args.peer and mode == "on" else []
            base = ["--shape", shape, "--device", "cuda", "--async-scheduling", mode]
            r = run("offline_throughput.py", base + extra, out_dir)
            rows.append(
                (
                    shape,
                    f"async {mode}",
                    "offline output tok/s",
                    f"{r['pdserve']['output_tok_per_s']:.0f}",
                )
            )
            if "vllm" in r:
                rows.append(
                    (shape, "vLLM", "offline output tok/s", f"{r['vllm']['output_tok_per_s']:.0f}")
                )
                rows.append((shape, f"async {mode}", "pdserve / vLLM", f"{r['ratio_vs_vllm']:.2f}"))
            r = run("offline_throughput.py", base + BATCH1, out_dir)
            ms = 1000 / r["pdserve"]["output_tok_per_s"]
            rows.append((shape, f"async {mode}", "engine batch-1 ms/token", f"{ms:.3f}"))
    r = run("model_step.py", ["decode", "--shapes", args.shapes, "--batches", "1,256"], out_dir)
    for row in r["decode"]:
        rows.append(
            (row["shape"], f"batch {row['batch']}", "model step ms (GPU)", f"{row['step_ms']:.3f}")
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print(f"\nrecords: {out_dir}")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    return rows


if __name__ == "__main__":
    main()
