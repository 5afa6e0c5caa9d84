"""A streamed KV chunk's gather beside the forward: a kernel against the copy engines.

    python benchmarks/kv_gather.py --shape llama-3.1-8b --tokens 512,2048 --held-layers 28

One GPU. A paged KV cache of the shape's geometry (``--cache-blocks``: its
layer stride is the copies' pitch); a prompt's blocks, either consecutive (one
run) or scattered. Per way (``--modes``, interleaved round
by round so that a drift of the GPU falls on all alike):

- ``none``: the layers alone (the baseline);
- ``kernel``: ``engine.kv_blocks.gather_blocks`` with no copier, an
  ``index_select`` on a side stream (the prefill node's way before the copy
  engines, and still its way for blocks that are not few runs);
- ``copy_engine``: the same call with the ids' runs and an
  ``engine.copy_engine.CopyEngine``: one pitched copy per run and K/V half
  (``--per-layer-copies``: one per layer too, as for a cache whose layer
  stride is over the driver's pitch limit, which would not fit one GPU here).

What is timed (CUDA events, medians): the gather of the first
``--held-layers`` layers' blocks alone, and ``--layers`` of the shape's layers
(``kv_stream_worker.layer_fn``: its matmuls and causal attention) computing
while that gather runs beside them on its own stream, as the prefill node's
held chunk does beside its last layers; ``added`` is that against ``none``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import rotated, save_run
from benchmarks.kv_stream_worker import geometry, layer_fn
from engine.models.shapes import SHAPES

MODES = ("none", "kernel", "copy_engine")


def _measure(args, tokens: int, scattered: bool) -> dict[str, Any]:
    import torch

    from engine.kv_blocks import block_runs, cache_copier, gather_blocks

    device = torch.device("cuda")
    g = geometry(args.shape)
    bs = args.block_size
    num_blocks = -(-tokens // bs)
    # A serving node's cache is far larger: its layer stride is the copies' pitch.
    total_blocks = args.cache_blocks or max(4 * num_blocks, 1024)
    if total_blocks < num_blocks:
        raise SystemExit(f"--cache-blocks: at least the prompt's {num_blocks}")
    cache = torch.randn(
        2, g["layers"], total_blocks, bs, g["kv_heads"], g["head_dim"],
        device=device, dtype=torch.bfloat16,
    )  # fmt: skip
    if scattered:
        ids = sorted(random.Random(0).sample(range(total_blocks), num_blocks))
    else:
        ids = list(range(num_blocks, 2 * num_blocks))
    runs = block_runs(ids)
    idx = torch.tensor(ids, device=device)
    copier = cache_copier(cache)
    if copier is None:
        raise SystemExit("the copy engines cannot be asked (no CUDA driver library)")
    if args.per_layer_copies:
        # As if this cache's layer stride were over the limit: a copy per layer.
        copier.max_pitch = min(copier.max_pitch, cache.stride(1) * cache.element_size() - 1)
    held = (0, args.held_layers)
    layer = layer_fn({"compute": "shape"}, g, tokens, device)
    side = torch.cuda.Stream(device)
    expected = gather_blocks(cache, idx, held)

    def gather(mode: str) -> torch.Tensor | None:
        side.wait_stream(torch.cuda.current_stream())  # as the streamer's: behind the layer
        if mode == "kernel":
            return gather_blocks(cache, idx, held, None, side)
        if mode == "copy_engine":
            return gather_blocks(cache, idx, held, None, side, runs, copier)
        return None

    for mode in MODES[1:]:  # each way gathers the same bytes
        out = gather(mode)
        torch.cuda.synchronize()
        if not torch.equal(out, expected):
            raise SystemExit(f"{mode}: the gathered KV differs from index_select's")
    alone: dict[str, list[float]] = {m: [] for m in MODES[1:]}
    beside: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.warmup + args.iters):
        for mode in rotated(list(MODES), i):
            if mode != "none":
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(side)
                gather(mode)
                e1.record(side)
                torch.cuda.synchronize()
                if i >= args.warmup:
                    alone[mode].append(e0.elapsed_time(e1))
            torch.cuda.synchronize()
            c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            layer()  # the layer whose end the gather waits for
            c0.record()
            gather(mode)
            for _ in range(args.layers):
                layer()
            c1.record()
            torch.cuda.synchronize()
            if i >= args.warmup:
                beside[mode].append(c0.elapsed_time(c1))
    base = statistics.median(beside["none"])
    row: dict[str, Any] = {
        "tokens": tokens,
        "blocks": "scattered" if scattered else "consecutive",
        "runs": len(runs),
        "held_bytes": expected.numel() * expected.element_size(),
        "layers_ms": {m: statistics.median(v) for m, v in beside.items()},
        "gather_ms": {m: statistics.median(v) for m, v in alone.items()},
    }
    # Median of the per-round differences against the round's own baseline.
    row["added_ms"] = {
        m: statistics.median(b - n for b, n in zip(beside[m], beside["none"], strict=True))
        for m in MODES[1:]
    }
    print(
        f"{tokens} tokens, {row['blocks']} blocks ({len(runs)} runs, "
        f"{row['held_bytes'] / 1e6:.0f} MB): {args.layers} layers {base:.3f} ms alone; "
        + "; ".join(
            f"{m}: gather {row['gather_ms'][m]:.3f} ms, layers +{row['added_ms'][m]:.3f} ms"
            for m in MODES[1:]
        ),
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="512,2048")
    p.add_argument("--held-layers", type=int, default=28, help="layers in the gathered chunk")
    p.add_argument("--layers", type=int, default=4, help="layers computing beside the gather")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--cache-blocks",
        type=int,
        default=0,
        help="blocks in the paged cache (0: four times the prompt's, at least 1024); "
        "an 8B shape on an H200 serves some 50,000",
    )
    p.add_argument(
        "--per-layer-copies",
        action="store_true",
        help="the copy engines copy a layer per call, as for a cache over their pitch limit",
    )
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    layers = SHAPES[args.shape]["num_hidden_layers"]
    if not 0 < args.held_layers <= layers:
        raise SystemExit(f"--held-layers: 1 to {layers} for {args.shape}")
    if args.layers < 1:
        raise SystemExit("--layers: at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("kv_gather.py needs a CUDA GPU")
    rows = [
        _measure(args, int(t), scattered)
        for t in args.tokens.split(",")
        for scattered in (False, True)
    ]
    return save_run("kv_gather", args, rows, argv)


if __name__ == "__main__":
    main()
