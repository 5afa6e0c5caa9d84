"""Tune the skinny GEMM (engine/layers/skinny_gemm.py) on this GPU against cuBLAS:
``tune_kernels.py --part gemv``, the kernel-tuning suite's part for it.

    python benchmarks/tune_kernels.py --part gemv                # Qwen3-0.6B and Llama-3.1-8B
    python benchmarks/tune_kernels.py --part gemv --write-table  # also store the winners

For each projection of the model shapes (qkv, o, gate_up, down: N x K) and
each token count M in 1, 2, 4, 8, 16 it times cuBLAS (F.linear) and a grid of
kernel configs in the same run, the way a decode step runs them: back to back
in a CUDA graph, each call on its own copy of the weight, so nothing is read
from L2. The search has two rounds: tile shapes (rows per program, K per
tile; FMA or tensor-core tile) at a fixed split/warps/stages, then split-K,
warps and pipeline stages around the best tile. It prints, per shape and M,
cuBLAS's time, the best config's, the speedup and the weight bandwidth each
reaches, and writes a JSON record. ``--write-table`` merges the results into
engine/layers/skinny_gemm_configs/<GPU>.json, which ``gemv_backend="auto"``
reads: the kernel is used where it was faster than cuBLAS by the plan's margin.
``--budget-s`` bounds the second round (the first always runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.common import environment, write_record
from engine.models.shapes import SHAPES

DEFAULT_SHAPES = ("qwen3-0.6b", "llama-3.1-8b")
M_VALUES = (1, 2, 4, 8, 16)


def projection_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of a named model shape (fused qkv and gate/up)."""
    cfg = SHAPES[shape]
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    return {
        "qkv_proj": ((heads + 2 * kv) * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_up_proj": (2 * cfg["intermediate_size"], hidden),
        "down_proj": (hidden, cfg["intermediate_size"]),
    }


def tile_candidates(m: int):
    from engine.layers.skinny_gemm import FMA_MAX_M, GemvConfig

    out = []
    if m <= 2 * FMA_MAX_M:  # FMA tiles (8 rows too, against the tensor-core tile)
        for bn, bk in itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024)):
            if m * bn * bk <= 32 * 1024:  # the [m, bn, bk] product fits the registers
                out.append(GemvConfig(bn, bk))
    if m > FMA_MAX_M:
        for bn, bk in itertools.product((16, 32, 64), (64, 128, 256)):
            out.append(GemvConfig(bn, bk, use_dot=True))
    return out


def around(best):
    from engine.layers.skinny_gemm import GemvConfig

    for split, warps, stages in itertools.product((1, 2, 4), (2, 4, 8), (2, 3, 4)):
        cfg = GemvConfig(best.block_n, best.block_k, split, warps, stages, best.use_dot)
        if cfg != best:
            yield cfg


def tune_one(n: int, k: int, m: int, device, dtype, deadline: float) -> dict[str, Any]:
    from engine.layers.skinny_gemm_plan import time_cublas_and_configs

    tiles = tile_candidates(m)
    cublas, times = time_cublas_and_configs(n, k, m, dtype, device, tiles)
    timed = [(t, c) for t, c in zip(times, tiles, strict=True) if t is not None]
    if not timed:  # every config failed to run here: the engine will keep cuBLAS
        return {"config": None, "triton_us": None, "cublas_us": cublas, "configs_tried": 0}
    best_t, best = min(timed, key=lambda tc: tc[0])
    tried = len(tiles)
    if time.monotonic() < deadline:
        more = list(around(best))
        _, times = time_cublas_and_configs(n, k, m, dtype, device, more)
        tried += len(more)
        for t, c in zip(times, more, strict=True):
            if t is not None and t < best_t:
                best_t, best = t, c
    return {
        "config": best.to_dict(),
        "triton_us": best_t,
        "cublas_us": cublas,
        "configs_tried": tried,
    }


def merge_table(path: Path, dtype_key: str, rows: list[dict[str, Any]]) -> None:
    table = json.loads(path.read_text()) if path.is_file() else {}
    by_shape = table.setdefault(dtype_key, {})
    for r in rows:
        entry = {k: r[k] for k in ("config", "triton_us", "cublas_us")}
        by_shape.setdefault(f"{r['n']}x{r['k']}", {})[str(r["m"])] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def main(argv: list[str], command: str) -> dict[str, Any]:
    """Parse ``argv`` (the options after ``--part gemv``), tune, write the record
    with ``command`` (the whole command line) and, asked to, the engine's table."""
    import torch

    from engine.layers import skinny_gemm_plan as sgp

    p = argparse.ArgumentParser(
        prog="tune_kernels.py --part gemv", description=__doc__.split("\n")[0]
    )
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    p.add_argument("--m", default=",".join(map(str, M_VALUES)), help="token counts")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--budget-s", type=float, default=240.0, help="time for the second round")
    p.add_argument("--write-table", action="store_true", help="store the winners for the engine")
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_kernels.py --part gemv needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    deadline = time.monotonic() + args.budget_s
    shapes: dict[tuple[int, int], list[str]] = {}
    for shape in args.shapes.split(","):
        for name, nk in projection_shapes(shape).items():
            shapes.setdefault(nk, []).append(f"{shape}.{name}")
    rows = []
    header = ("layer", "N x K", "M", "cuBLAS us", "ours us", "speedup", "cuBLAS GB/s", "ours GB/s")
    print("{:40} {:>12} {:>3} {:>10} {:>8} {:>7} {:>11} {:>9}  config".format(*header))
    for (n, k), names in shapes.items():
        nbytes = n * k * torch.empty(0, dtype=dtype).element_size()
        for m in (int(v) for v in args.m.split(",")):
            r = tune_one(n, k, m, device, dtype, deadline)
            r.update(layers=names, n=n, k=k, m=m)
            rows.append(r)
            if r["config"] is None:
                print(f"{names[0]:40} {f'{n}x{k}':>12} {m:3d}: no config ran", flush=True)
                continue
            print(
                f"{names[0]:40} {f'{n}x{k}':>12} {m:3d} {r['cublas_us']:10.2f} "
                f"{r['triton_us']:8.2f} {r['cublas_us'] / r['triton_us']:6.2f}x "
                f"{nbytes / r['cublas_us'] / 1e3:11.0f} {nbytes / r['triton_us'] / 1e3:9.0f}  "
                f"{r['config']}",
                flush=True,
            )
    results = {"device": torch.cuda.get_device_name(device), "dtype": args.dtype, "rows": rows}
    if args.write_table:
        path = sgp.table_path(device)
        merge_table(path, args.dtype, rows)
        results["table"] = str(path)
        print(f"table: {path}")
    record = {"environment": environment(), "results": results}
    path, _ = write_record("tune_gemv", record, command, args.out_dir)
    print(f"record: {path}")
    return results
