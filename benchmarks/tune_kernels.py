"""Tune our Triton kernels on this GPU: the attention kernels' launch
configurations and the skinny GEMM's table.

    python benchmarks/tune_kernels.py
    python benchmarks/tune_kernels.py --part short-prefill
    python benchmarks/tune_kernels.py --part split-prefill [--sweep | --sweep-splits]
    python benchmarks/tune_kernels.py --part gemv [--write-table]

Prints the time of each configuration for a few representative shapes
(Llama-3.1-8B's and Qwen3-0.6B's attention heads) and the best one per kernel
over all shapes (geometric mean); the defaults in triton_kernels.py come from
this sweep. ``--part short-prefill`` sweeps the prefill kernel on what a
serving step carries when requests arrive: a few prompts of 16 to 512 new
tokens each on a cached prefix (``--prefix-len``), against the configuration
triton_kernels.py picks for them today. ``--part split-prefill`` times the
prefill split over the context (triton_prefill_split.py) against the unsplit
kernel on short queries over the cached prefix, one and several prompts: each
kernel's device time (ten calls replayed from a CUDA graph, so no launch cost),
its time launched eagerly (what a step pays, launches included), the largest
difference of the two outputs; ``--sweep`` adds split counts and tile configs,
``--sweep-splits`` split counts only. ``--part gemv`` times the skinny GEMM
against cuBLAS and, with ``--write-table``, stores the winners where the
engine reads them (gemv_tuning.py says how; its options follow ``--part gemv``).
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.attention_kernels import make_cache
from benchmarks.common import command_line, cuda_time_ms, environment, write_record

PARTS = ["all", "short-prefill", "split-prefill", "gemv"]


DECODE_SHAPES = [(256, 1024, 32, 8), (64, 1024, 32, 8), (256, 4096, 32, 8), (256, 1024, 16, 8)]


def main(argv=None):
    import argparse

    # The skinny GEMM's part has options of its own: everything after --part gemv is its.
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--part", choices=PARTS, default="all")
    part, rest = first.parse_known_args(argv)
    if part.part == "gemv":
        from benchmarks import gemv_tuning

        return gemv_tuning.main(rest, command_line("tune_kernels.py", argv))

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path)
    parser.add_argument("--part", choices=PARTS, default="all")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true", help="split-prefill: counts and configs")
    parser.add_argument("--sweep-splits", action="store_true", help="split-prefill: counts")
    args = parser.parse_args(argv)
    if args.part == "short-prefill":
        return short_prefill(args, argv)
    if args.part == "split-prefill":
        return split_prefill(args, argv)
    return attention_configs(args, argv)


def attention_configs(args, argv) -> None:
    """The decode and prefill kernels' launch configurations, each timed on a
    few shapes; the best per kernel by geometric mean over the shapes."""
    results = {"decode": sweep_decode(), "prefill": sweep_prefill()}
    best = {}
    for kind, table in results.items():
        scored = {c: math.exp(sum(math.log(t) for t in ts) / len(ts)) for c, ts in table.items()}
        best[kind] = min(scored, key=scored.get)
        print(f"best {kind}: {best[kind]} ({scored[best[kind]]:.4f} ms geometric mean)")
    record = {
        "environment": environment(),
        "parameters": {"decode_shapes": DECODE_SHAPES},
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


def sweep_decode() -> dict[str, list[float]]:
    """ms per call of each decode configuration on every DECODE_SHAPES case."""
    import torch

    from engine.layers.attention import triton_decode as td

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out_table = {}
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
        cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        times = []
        for batch, ctx, heads, kv_heads in DECODE_SHAPES:
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
            out_table[str(cfg)] = times
            print(f"decode {cfg}: {[round(t, 4) for t in times]}", flush=True)
    return out_table


def sweep_prefill() -> dict[str, list[float]]:
    """ms per call of each prefill configuration on 8 prompts of 2048 tokens."""
    import torch

    from engine.layers.attention import triton_kernels as tk

    out_table = {}
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
        out_table[str(cfg)] = [t]
        print(f"prefill {cfg}: {t:.4f}", flush=True)
    return out_table


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


def graph_time_us(torch, fn, calls: int = 10) -> float:
    """Device time of one call: ``calls`` calls captured in a CUDA graph, replayed."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time_ms(graph.replay, iters=20) * 1e3 / calls


def split_prefill(args, argv) -> None:
    """Each (prompts, new tokens) case: the unsplit kernel against the split one."""
    import torch

    from engine.layers.attention import triton_kernels as tk
    from engine.layers.attention import triton_prefill_split as ts

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads, kv_heads = 32, 8  # Llama-3.1-8B
    cases = [(1, 32), (1, 64), (1, 128), (4, 32), (2, 128), (4, 128), (8, 128), (1, 512)]
    configs = [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}
        for m, n, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
    ]
    results = {}
    for seqs, new in cases:
        ctx = args.prefix_len + new
        k, v, tables = make_cache(torch, seqs, ctx, 16, kv_heads)
        q = torch.randn(seqs * new, heads, 128, dtype=torch.bfloat16, device="cuda")
        qsl = torch.arange(0, (seqs + 1) * new, new, dtype=torch.int32, device="cuda")
        lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
        rule = ts.prefill_num_splits(seqs, kv_heads, heads // kv_heads, new, ctx, sms)
        ref, out = torch.empty_like(q), torch.empty_like(q)

        def run(dst, splits=0, cfg=None):
            """One call: the unsplit kernel (splits 0) or the split one (1 split too)."""
            if not splits:
                return lambda: tk.prefill_attention(q, k, v, dst, tables, qsl, lens, new, 0.088)
            ws = ts.make_workspace(q.shape[0], heads, 128, splits, "cuda") if splits > 1 else None
            return lambda: ts.prefill_split_attention(
                q, k, v, dst, tables, qsl, lens, new, 0.088, splits, ws, cfg
            )

        row = {"rule_splits": rule, "unsplit_us": graph_time_us(torch, run(ref))}
        row["unsplit_eager_us"] = cuda_time_ms(run(ref), iters=50) * 1e3
        n = max(rule, 1)  # the split kernel even where the rule says no: what it would cost
        row["split_us"] = graph_time_us(torch, run(out, n))
        row["split_eager_us"] = cuda_time_ms(run(out, n), iters=50) * 1e3
        row["split_max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
        if args.sweep or args.sweep_splits:
            row["by_splits"] = {
                s: graph_time_us(torch, run(out, s)) for s in (1, 2, 3, 4, 6, 8, 12, 16)
            }
            print("  by splits: " + ", ".join(f"{s}: {t:.1f}" for s, t in row["by_splits"].items()))
        if args.sweep:
            row["by_config"] = {}
            for cfg in configs:
                try:
                    row["by_config"][str(cfg)] = graph_time_us(torch, run(out, n, cfg))
                except Exception as e:  # out of shared memory, etc.
                    print(f"  {cfg}: {type(e).__name__}")
            best = min(row["by_config"], key=row["by_config"].get)
            print(f"  splits {n}: best {row['by_config'][best]:.1f} us {best}", flush=True)
        results[f"{seqs}x{new}"] = row
        print(
            f"{seqs} x {new:3d} new on {args.prefix_len} cached: unsplit {row['unsplit_us']:6.1f} us "
            f"(eager {row['unsplit_eager_us']:6.1f}), {n} splits {row['split_us']:6.1f} us "
            f"(eager {row['split_eager_us']:6.1f}) = {row['unsplit_us'] / row['split_us']:.2f}x; "
            f"rule {rule}; max |diff| {row['split_max_abs_diff']:.2e}",
            flush=True,
        )
    record = {
        "environment": environment(),
        "parameters": {"part": "split-prefill", "prefix_len": args.prefix_len, "cases": cases},
        "results": results,
    }
    path, _ = write_record(
        "tune_kernels", record, command_line("tune_kernels.py", argv), args.out_dir
    )
    print(f"record: {path}")


if __name__ == "__main__":
    main()
