"""The Triton prefill-attention kernel at a mixed step's shapes, on one GPU, against
another tree's kernel (Llama-3.1-8B attention: 32 query heads, 8 KV heads of 128;
16-token pages).

Both kernels are the engines' own: this tree's ``prefill_attention`` and, with
``--baseline-tree DIR``, the ``triton_kernels.py`` of another checkout (loaded
under another module name; its imports resolve to this tree, so the rest of the
attention package must be the same in both). What chose f75d30d runs as

    git worktree add /tmp/base 0214bdd   # or: git archive 0214bdd | tar -x -C /tmp/base
    python benchmarks/prefill_kernel_ab.py --baseline-tree /tmp/base

For each case it times the decode kernel, the prefill kernel, both in turn (as
a mixed step runs them) and both on two streams, the baseline's prefill kernel
and both in turn with it, and records the largest difference between the two
kernels' outputs (``maxdiff``, unrounded: bf16 units in the last place are
1e-3 here); ``--sweep`` also times this tree's kernel in 16 tile / warp /
stage configurations. A diagnostic: every figure is a kernel time between CUDA
events (median of 7 repeats of 64 launches), not a serving or offline run.
The figures compared with the baseline's (this tree's prefill and both in
turn, and the baseline's) are timed interleaved instead, the order rotated
each of 8 rounds (``benchmarks.common.cuda_times_ms_interleaved``): timed
block by block, an A/A of one kernel came out 0.975x.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import random
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cuda_time_ms, cuda_times_ms_interleaved, save_run
from engine.layers.attention import triton_decode as td
from engine.layers.attention import triton_kernels as tk

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
NUM_BLOCKS = 40000
# name: (decode rows, prompt lengths, prefix-cache hit per prompt)
CASES = {
    "127dec+2x1024": (127, [1024, 1024], 0),
    "127dec+1x1024": (127, [1024], 0),
    "64dec+1x1024": (64, [1024], 0),
    "192dec+3x1024": (192, [1024, 1024, 1024], 0),
    "96dec+2x1024": (96, [1024, 1024], 0),
    "0dec+8x1024": (0, [1024] * 8, 0),
    "127dec+1x1024@1024": (127, [1024], 1024),
    "16dec+1x2048": (16, [2048], 0),
}
SWEEP = [
    {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
    for m, n, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))
    if not (m == 128 and w == 4)
]


def load_kernels(tree: Path):
    """``tree``'s engine/layers/attention/triton_kernels.py as a module of its own."""
    path = tree / "engine" / "layers" / "attention" / "triton_kernels.py"
    if not path.is_file():
        raise SystemExit(f"--baseline-tree: no {path}")
    spec = importlib.util.spec_from_file_location("baseline_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_us(fn, iters: int = 64, reps: int = 7) -> float:
    """Median over ``reps`` of the mean time of ``iters`` launches back to back, µs."""
    return cuda_time_ms(fn, warmup=3, iters=reps, batch=iters) * 1e3


def make_case(num_decodes: int, prompts: list[int], prefix: int, device: torch.device) -> dict:
    rng = random.Random(1)
    seq_lens = [rng.randint(1024, 1151) for _ in range(num_decodes)]
    seq_lens += [prefix + p for p in prompts]
    query_lens = [1] * num_decodes + prompts
    width = triton.cdiv(max(seq_lens), PAGE)
    blocks = torch.randperm(NUM_BLOCKS, device=device)[: len(seq_lens) * width]
    return {
        "q": torch.randn(sum(query_lens), HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
        "block_tables": blocks.view(len(seq_lens), width).int(),
        "query_start_loc": torch.tensor(
            [0, *itertools.accumulate(query_lens)], device=device, dtype=torch.int32
        ),
        "seq_lens": torch.tensor(seq_lens, device=device, dtype=torch.int32),
        "max_query_len": max(prompts),
    }


def run_case(name: str, spec: tuple, caches, baseline, sweep: bool, side: torch.cuda.Stream):
    k_cache, v_cache = caches
    device, scale = k_cache.device, HEAD_DIM**-0.5
    num_decodes = spec[0]
    c = make_case(*spec, device)
    q, d = c["q"], num_decodes
    out, base_out = torch.empty_like(q), torch.empty_like(q)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    max_decode_len = int(c["seq_lens"][:d].max()) if d else 1
    splits = td.decode_num_splits(d, KV_HEADS, max_decode_len, sms) if d else 0
    prompt_args = (
        c["block_tables"][d:],
        c["query_start_loc"][d:] - d,
        c["seq_lens"][d:],
        c["max_query_len"],
        scale,
    )

    def decode():
        if d:
            td.decode_attention(
                q[:d], k_cache, v_cache, out[:d], c["block_tables"][:d], c["seq_lens"][:d],
                scale, splits,
            )  # fmt: skip

    def prefill(module=tk, o=out, config=None):
        module.prefill_attention(q[d:], k_cache, v_cache, o[d:], *prompt_args, config=config)

    def both():
        decode()
        prefill()

    def two_streams():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            decode()
        prefill()
        main.wait_stream(side)

    row = {
        "decode_us": kernel_us(decode) if d else 0.0,
        "prefill_us": kernel_us(prefill),
        "both_us": kernel_us(both),
        "two_streams_us": kernel_us(two_streams),
    }
    if baseline is not None:
        # The two kernels' repeats interleaved: timed block by block, whichever
        # ran first came out faster (an A/A of one kernel gave 0.975x).
        ab = cuda_times_ms_interleaved(
            {
                "prefill_us": prefill,
                "baseline_prefill_us": lambda: prefill(baseline, base_out),
                "both_us": both,
                "baseline_both_us": lambda: (decode(), prefill(baseline, base_out)),
            },
            iters=8,
            batch=64,
        )
        row.update({k: v * 1e3 for k, v in ab.items()})
        prefill()
        prefill(baseline, base_out)
        row["maxdiff"] = float((out[d:].float() - base_out[d:].float()).abs().max())
        row["identical"] = bool(torch.equal(out[d:], base_out[d:]))
    if sweep:
        row["sweep_us"] = {}
        for config in SWEEP:
            key = "{BLOCK_M}x{BLOCK_N}_{num_warps}w{num_stages}s".format(**config)
            try:
                row["sweep_us"][key] = kernel_us(lambda cfg=config: prefill(config=cfg), 32, 5)
            except Exception as e:  # a configuration out of shared memory: the next one
                print(f"   {key}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                row["sweep_us"][key] = None
    # Times rounded, the difference in full (rounded it reads 0.0 for 2 bf16 ulps).
    shown = {k: round(v, 1) if k.endswith("_us") else v for k, v in row.items() if k != "sweep_us"}
    print(name, shown, flush=True)
    if sweep:
        ran = [kv for kv in row["sweep_us"].items() if kv[1] is not None]
        top = sorted(ran, key=lambda kv: kv[1])[:4]
        print("   fastest configurations:", [(k, round(v, 1)) for k, v in top], flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-tree", type=Path, help="another checkout whose kernel to time")
    p.add_argument("--sweep", action="store_true", help="also sweep this tree's launch configs")
    p.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_kernel_ab.py needs a CUDA GPU")
    baseline = load_kernels(args.baseline_tree) if args.baseline_tree else None
    device = torch.device("cuda")
    torch.manual_seed(0)
    shape = (NUM_BLOCKS, PAGE, KV_HEADS, HEAD_DIM)
    caches = tuple(torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    side = torch.cuda.Stream()
    rows = {
        name: run_case(name, CASES[name], caches, baseline, args.sweep, side) for name in args.cases
    }
    if baseline is not None:
        ratios = [r["prefill_us"] / r["baseline_prefill_us"] for r in rows.values()]
        geomean = statistics.geometric_mean(ratios)
        print(f"prefill kernel time against the baseline's, geometric mean: {geomean:.3f}x")
        rows["geomean_prefill_ratio"] = geomean
    return save_run("prefill_kernel_ab", args, rows, argv)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
