"""Sweep launch configurations of our Triton attention kernels on this GPU.

    python benchmarks/tune_kernels.py
    python benchmarks/tune_kernels.py --part short-prefill

Prints the time of each configuration for a few representative shapes
(Llama-3.1-8B's and Qwen3-0.6B's attention heads) and the best one per kernel
over all shapes (geometric mean); the defaults in triton_kernels.py come from
this sweep. ``--part short-prefill`` sweeps the prefill kernel on what a
serving step carries when requests arrive: a few prompts of 16 to 512 new
tokens each on a cached prefix (``--prefix-len``), against the configuration
triton_kernels.py picks for them today.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernels import make_cache
from benchmarks.common import command_line, cuda_time_ms, environment, write_record


def main(argv=None):
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--part", choices=["all", "short-prefill"], default="all")
    parser.add_argument("--prefix-len", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.part == "short-prefill":
        return short_prefill(args, argv)

    from engine.layers.attention import triton_decode as td
    from engine.layers.attention import triton_kernels as tk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"decode": {}, "prefill": {}}
    decode_shapes = [(256, 1024, 32, 8), (64, 1024, 32, 8), (256, 4096, 32, 8), (256, 1024, 16, 8)]
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
        cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        times = []
        for batch, ctx, heads, kv_heads in decode_shapes:
            k, v, tables = make_cache(torch, batch, ctx, 16, kv_heads)
            q = torch.randn(batch, heads, 128, dtype=torch.bfloat16, device="cuda")
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            splits = td.decode_num_splits(batch, kv_heads, ctx, sms)
            try:
                times.append(
                    cuda_time_ms(
                        lambda: td.decode_attention(
                            q, k, v, out, tables, lens, 0.088, splits, config=cfg
                        )
                    )
                )
            except Exception as e:  # out of shared memory, etc.
                print(f"decode {cfg}: {type(e).__name__}")
                times = None
                break
        if times:
            results["decode"][str(cfg)] = times
            print(f"decode {cfg}: {[round(t, 4) for t in times]}", flush=True)
    for block_m, block_n, warps, stages in itertools.product(
        (64, 128), (32, 64, 128), (4, 8), (1, 2, 3)
    ):
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        k, v, tables = make_cache(torch, 8, 2048, 16, 8)
        q = torch.randn(8 * 2048, 32, 128, dtype=torch.bfloat16, device="cuda")
        qsl = torch.arange(0, 9 * 2048, 2048, dtype=torch.int32, device="cuda")
        lens = torch.full((8,), 2048, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        try:
            t = cuda_time_ms(
                lambda: tk.prefill_attention(
                    q, k, v, out, tables, qsl, lens, 2048, 0.088, config=cfg
                )
            )
        except Exception as e:
            print(f"prefill {cfg}: {type(e).__name__}")
            continue
        results["prefill"][str(cfg)] = [t]
        print(f"prefill {cfg}: {t:.4f}", flush=True)
    best = {}
    for kind, table in results.items():
        scored = {c: math.exp(sum(math.log(t) for t in ts) / len(ts)) for c, ts in table.items()}
        best[kind] = min(scored, key=scored.get)
        print(f"best {kind}: {best[kind]} ({scored[best[kind]]:.4f} ms geometric mean)")
    record = {
        "environment": environment(),
        "parameters": {"decode_shapes": decode_shapes},
        "results": results,
        "best": best,
    }
    path, _ = write_record(
        "tune_kernels",
        record,
        command_line("tune_kernels.py", argv),
        args.out_dir,
    )
    print(f"record: {path}")


def short_prefill(args, argv) -> None:
    """Each (prompts, new tokens) case: every configuration's time and the default's."""
    import torch

    from engine.layers.attention import triton_kernels as tk

    cases = [(1, 16), (1, 32), (1, 64), (1, 128), (1, 256), (1, 512), (4, 128), (4, 512)]
    configs = [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}
        for m, n, w, st in itertools.product((16, 32, 64), (32, 64, 128), (2, 4, 8), (1, 2, 3))
    ]
    results = {}
    for seqs, new in cases:
        ctx = args.prefix_len + new
        k, v, tables = make_cache(torch, seqs, ctx, 16, 8)
        q = torch.randn(seqs * new, 32, 128, dtype=torch.bfloat16, device="cuda")
        qsl = torch.arange(0, (seqs + 1) * new, new, dtype=torch.int32, device="cuda")
        lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)

        def run(cfg=None):
            tk.prefill_attention(q, k, v, out, tables, qsl, lens, new, 0.088, config=cfg)

        default = cuda_time_ms(run, iters=50)
        times = {}
        for cfg in configs:
            try:
                times[str(cfg)] = cuda_time_ms(lambda cfg=cfg: run(cfg), iters=50)
            except Exception as e:  # out of shared memory, etc.
                print(f"  {cfg}: {type(e).__name__}")
        best = min(times, key=times.get)
        results[f"{seqs}x{new}"] = {"default_ms": default, "times": times, "best": best}
        print(
            f"{seqs} x {new:3d} new on {args.prefix_len} cached: default {default * 1e3:7.1f} us, "
            f"best {times[best] * 1e3:7.1f} us ({default / times[best]:.2f}x) {best}",
            flush=True,
        )
    record = {
        "environment": environment(),
        "parameters": {"part": "short-prefill", "prefix_len": args.prefix_len, "cases": cases},
        "results": results,
    }
    path, _ = write_record(
        "tune_kernels", record, command_line("tune_kernels.py", argv), args.out_dir
    )
    print(f"record: {path}")


if __name__ == "__main__":
    main()
