"""Tune and measure the fused MoE kernel on this GPU (a command, not imported by the engine).

    python -m engine.layers.moe.tune --shape qwen3-30b-a3b --write-table --out moe.json

For each token count (decode batches to prefill chunks) of a named model
shape's MoE layer (engine/models/shapes.py; ``--tp`` divides each expert's
intermediate size as tensor parallelism does): every candidate launch
config is timed, and the record holds, measured in the same run, the best
config's time, the default config's, the torch reference loop's
(engine/layers/moe/reference.py), a dense cuBLAS GEMM of the same FLOPs (all
pairs through one expert's weights, no gather), and the floor no kernel can
beat: max(weight bytes of the experts the tokens chose / copy bandwidth,
FLOPs / dense bf16 matmul rate). ``--write-table`` merges the best configs
into ``engine/layers/moe_configs/<GPU>.json``, which the engine reads.

Kernel times replay a CUDA graph of several calls, each with its own routing
(so a call does not find the previous one's experts in L2), as a decode
step's graph runs the layer; the reference loop reads the routing on the
host and runs eagerly.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from engine.layers.activation import SiluAndMul
from engine.layers.moe import configs as moe_configs
from engine.layers.moe.configs import MoeKernelConfig
from engine.layers.moe.fused_moe import fused_experts
from engine.layers.moe.reference import reference_experts
from engine.layers.moe.routing import select_experts
from engine.layers.tuned_tables import table_file_name

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ROUTINGS = 8  # calls per timed graph, each with its own routing
REFERENCE_MAX_TOKENS = 8192


def candidates(num_tokens: int, num_experts: int, top_k: int) -> list[MoeKernelConfig]:
    """Configs worth timing for this many tokens (about ten, each a compile of
    two kernel variants): 16-row tiles while each expert sees a handful of rows
    (decode reads the weights once; wider tiles would be padding), wider ones
    as the rows per expert grow (prefill is tensor-core bound)."""
    per_expert = num_tokens * top_k / num_experts
    out = [moe_configs.default_config(num_tokens, num_experts, top_k)]
    if per_expert <= 16:
        for bn in (64, 128):
            for bk in (128, 256):
                for stages in (3, 4):
                    out.append(MoeKernelConfig(16, bn, bk, 1, 4, stages))
    else:
        for bm in (32, 64, 128):
            if bm > 2 * per_expert:
                continue
            for bn, bk, warps in ((64, 64, 4), (128, 64, 8), (128, 128, 8)):
                out.append(MoeKernelConfig(bm, bn, bk, 8, warps, 3))
    return list(dict.fromkeys(out))


def graph_time_us(fn, calls: int, iters: int = 10) -> float:
    """Median time of one of ``calls`` calls captured in a CUDA graph, in us."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up, compiles
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return _median_us(graph.replay, iters) / calls


def _median_us(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def device_rates() -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, dense bf16 FLOP/s)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_us = _median_us(lambda: dst.copy_(src), 5)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_us = _median_us(lambda: a @ a, 5)
    return 2 * n * 2 / (copy_us / 1e6), 2 * 8192**3 / (mm_us / 1e6)


def measure(layer: dict[str, Any], num_tokens: int, rates: tuple[float, float], budget_s: float):
    """One token count's record: the best config and every reference time."""
    w13, w2, top_k = layer["w13"], layer["w2"], layer["top_k"]
    num_experts, two_i, hidden = w13.shape
    act = SiluAndMul(fused=True)
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    xs, routes = [], []
    for _ in range(ROUTINGS):
        xs.append(torch.randn(num_tokens, hidden, device="cuda", dtype=w13.dtype, generator=gen))
        logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
        routes.append(select_experts(logits, top_k, True))

    def run(config):
        return lambda i: fused_experts(xs[i], w13, w2, *routes[i], config, act)

    default = moe_configs.default_config(num_tokens, num_experts, top_k)
    times: dict[MoeKernelConfig, float] = {}
    deadline = time.monotonic() + budget_s
    for config in candidates(num_tokens, num_experts, top_k):
        if times and time.monotonic() > deadline:
            break
        times[config] = graph_time_us(run(config), ROUTINGS)
    best = min(times, key=times.get)
    out = run(best)(0)
    ref_us = err = None
    if num_tokens <= REFERENCE_MAX_TOKENS:
        ref = reference_experts(xs[0], w13, w2, *routes[0], act)
        err = (out.float() - ref.float()).abs().max().item()
        ref_us = _median_us(lambda: reference_experts(xs[0], w13, w2, *routes[0], act), 5)
    pairs = num_tokens * top_k
    a = xs[0].repeat_interleave(top_k, 0)
    b13, b2 = w13[0].t().contiguous(), w2[0].t().contiguous()
    dense_us = graph_time_us(lambda i: torch.mm(torch.mm(a, b13)[:, : two_i // 2], b2), 1)
    hit = sum(len(torch.unique(r[1])) for r in routes) / ROUTINGS
    weight_bytes = hit * (w13[0].numel() + w2[0].numel()) * w13.element_size()
    flops = 2 * pairs * (w13[0].numel() + w2[0].numel())
    floor_us = max(weight_bytes / rates[0], flops / rates[1]) * 1e6
    return {
        "config": best.to_dict(),
        "fused_us": times[best],
        "default_us": times.get(default),
        "configs_timed": len(times),
        "reference_us": ref_us,
        "dense_gemm_us": dense_us,
        "floor_us": floor_us,
        "fraction_of_floor": floor_us / times[best],
        "experts_hit": hit,
        "max_abs_err_vs_reference": err,
    }


def expert_layer(shape: str, tp: int, dtype: torch.dtype) -> dict[str, Any]:
    from engine.models.config import ModelArchConfig
    from engine.models.shapes import SHAPES

    cfg = ModelArchConfig.from_dict(SHAPES[shape])
    if cfg.moe is None:
        raise ValueError(f"shape {shape!r} has no mixture-of-experts layers")
    moe = cfg.moe
    inter = moe.intermediate_size // tp
    e, h = moe.num_experts, cfg.hidden_size
    w13 = torch.empty(e, 2 * inter, h, device="cuda", dtype=dtype).normal_(0, h**-0.5)
    w2 = torch.empty(e, h, inter, device="cuda", dtype=dtype).normal_(0, inter**-0.5)
    return {"w13": w13, "w2": w2, "top_k": moe.top_k, "key": (e, inter, h, moe.top_k)}


def write_table(records: dict[int, dict], key: tuple, dtype: str) -> Path:
    path = moe_configs.CONFIG_DIR / table_file_name(torch.cuda.get_device_name())
    table = json.loads(path.read_text()) if path.is_file() else {}
    entries = table.setdefault(dtype, {}).setdefault(moe_configs.shape_key(*key), {})
    for m, rec in records.items():
        entries[str(m)] = {k: rec[k] for k in ("config", "fused_us", "default_us", "reference_us")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (splits each expert)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--budget-s", type=float, default=15.0, help="sweep time per token count")
    p.add_argument("--write-table", action="store_true")
    p.add_argument("--out", type=Path, help="the JSON record (default: printed only)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    layer = expert_layer(args.shape, args.tp, dtype)
    rates = device_rates()
    print(f"copy {rates[0] / 1e12:.2f} TB/s, bf16 matmul {rates[1] / 1e12:.0f} TFLOP/s")
    records: dict[int, dict] = {}
    for m in (int(t) for t in args.tokens.split(",")):
        rec = records[m] = measure(layer, m, rates, args.budget_s)
        ref = rec["reference_us"]
        print(
            f"tokens {m:5d}: fused {rec['fused_us']:9.1f} us "
            f"({100 * rec['fraction_of_floor']:3.0f}% of floor {rec['floor_us']:8.1f}), "
            f"default {rec['default_us'] or math.nan:9.1f}, reference {ref or math.nan:9.1f}, "
            f"dense GEMM {rec['dense_gemm_us']:8.1f}, {rec['experts_hit']:.0f} experts, "
            f"{rec['configs_timed']} configs, err {rec['max_abs_err_vs_reference']}",
            flush=True,
        )
    result = {
        "shape": args.shape,
        "tp": args.tp,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(),
        "copy_bytes_per_s": rates[0],
        "matmul_flops_per_s": rates[1],
        "expert_key": moe_configs.shape_key(*layer["key"]),
        "records": records,
    }
    if args.write_table:
        print(f"table: {write_table(records, layer['key'], args.dtype)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"record: {args.out}")
    return result


if __name__ == "__main__":
    main()
