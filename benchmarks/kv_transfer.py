"""KV streaming between two processes: pdserve's path against raw send/recv of the same bytes.

    python benchmarks/kv_transfer.py --device cpu                       # gloo, smollm2-135m shape
    python benchmarks/kv_transfer.py --device cuda --shape llama-3.1-8b  # NCCL, two GPUs

Two processes (one GPU each on CUDA), each holding a paged KV cache of the
shape's layout, blocks drawn at random on both sides. The prefill side runs
the prefill node's real streamer (prefill_node/kv_stream.py) and KVSender under
a synthetic forward: per layer, work standing in for the layer (``--compute``:
``shape``, the layer's own matmuls and causal attention for that many tokens;
``fixed``, a matmul loop busy for ``--layer-ms``), then the streamer's
per-layer hook. The decode side runs a real KVReceiver whose sink scatters each
chunk into its cache as the decode node's landing does. Per prompt length and
``--layers-per-chunk`` value (0: a step's blocks of every layer in one chunk,
after the last layer -- the whole-request transfer):

- raw: one send/recv of a buffer of the request's size between the same
  processes, in the same run (the baseline), and the same bytes as one
  message per layer, all posted at once (what chunking costs the wire itself);
- wire: the chunks' time on the wire (the sender's own measure: CUDA events on
  a GPU, send to completion on a CPU), summed; its ratio to raw. Measured twice:
  with every chunk queued at once and no compute (on a GPU the sender's thread
  posts one send at a time and the stream waits for each post, so this is
  the host's posting rate as much as the wire's), and under the forward, where
  each send is posted before its layers ran and starts when they are done
  (the wire as a request sees it);
- exposed: from the last layer's end (host-observed) to the last chunk
  scattered on the decode side: what of the transfer a request still waits
  for after its prefill, with the prefill side's own figure beside it;
- forward: the synthetic forward's duration (what streaming costs the compute),
  and without compute the engine thread's time gathering and queueing chunks.

Medians over ``--iters`` after ``--warmup``. ``--trace-dir DIR``: each rank's
streamed runs under torch.profiler, as a gzipped Chrome trace in DIR.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run
from benchmarks.kv_stream_worker import Compute
from engine.models.shapes import SHAPES


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from pdserve.redis_server import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--shape", default=None, choices=sorted(SHAPES))
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--layers-per-chunk", default="1,2,4,0", help="values to compare; 0: whole")
    p.add_argument(
        "--last-layers",
        type=int,
        default=0,
        help="only a step's last N layers streamed, the ones before in one chunk (every run)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--compute", type=Compute, choices=list(Compute), default=None)
    p.add_argument("--layer-ms", type=float, default=20.0, help="per layer, --compute fixed")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out-dir", type=Path)
    p.add_argument(
        "--trace-dir", help="write each rank's Chrome trace (torch.profiler) of the streamed runs"
    )
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs two GPUs")
    args.shape = args.shape or ("llama-3.1-8b" if cuda else "smollm2-135m")
    args.compute = args.compute or (Compute.SHAPE if cuda else Compute.FIXED)
    args.iters = args.iters or (10 if cuda else 5)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    results, acks = ctx.Queue(), ctx.Queue()
    ports = (free_port(), free_port())
    from benchmarks.kv_stream_worker import run_rank

    # Plain values only: an enum pickled from __main__ is another class in the children.
    a = {**vars(args), "compute": args.compute.value, "out_dir": None}
    procs = [ctx.Process(target=run_rank, args=(r, a, ports, (results, acks))) for r in (1, 0)]
    for proc in procs:
        proc.start()
    outs = {o["rank"]: o for o in (results.get(timeout=3600) for _ in procs)}
    for proc in procs:
        proc.join(60)
    for o in outs.values():
        if "error" in o:
            raise SystemExit(f"rank {o['rank']} failed: {o['error']}")
    sender, receiver = outs[0], outs[1]
    rows = []
    med = statistics.median
    for tokens in [int(t) for t in args.tokens.split(",")]:
        raw = sender["raw"][tokens]
        for lpc in [int(x) for x in args.layers_per_chunk.split(",")]:
            bare, busy = sender["runs"][(tokens, lpc, False)], sender["runs"][(tokens, lpc, True)]
            landed = receiver["landed"]
            wire = med(r["wire_s"] for r in bare)
            wire_busy = med(r["wire_s"] for r in busy)
            row = {
                "tokens": tokens,
                "layers_per_chunk": lpc,
                "last_layers": args.last_layers,
                "bytes": raw["bytes"],
                "raw_ms": raw["seconds"] * 1e3,
                "raw_per_layer_ms": raw["per_layer_seconds"] * 1e3,
                "wire_ms": wire * 1e3,
                "wire_vs_raw": raw["seconds"] / wire,
                "wire_under_forward_ms": wire_busy * 1e3,
                "wire_under_forward_vs_raw": raw["seconds"] / wire_busy,
                "end_to_end_ms": med(landed[r["rid"]] - r["start"] for r in bare) * 1e3,
                # Without compute: the engine thread's own share (gathers, queueing).
                "engine_gather_ms": med(r["forward_s"] for r in bare) * 1e3,
                "exposed_ms": med(landed[r["rid"]] - r["last_layer_at"] for r in busy) * 1e3,
                "exposed_sender_ms": med(r["exposed_s"] for r in busy) * 1e3,
                "forward_ms": med(r["forward_s"] for r in busy) * 1e3,
            }
            rows.append(row)
            print(
                f"{tokens:5d} tokens ({raw['bytes'] / 2**20:6.1f} MiB), "
                f"{'whole' if lpc == 0 else f'{lpc} layer(s)'}/chunk: raw {row['raw_ms']:.3f} ms "
                f"({row['raw_per_layer_ms']:.3f} as a message per layer), "
                f"wire {row['wire_ms']:.3f} ms ({100 * row['wire_vs_raw']:.0f}% of raw), "
                f"under the forward {row['wire_under_forward_ms']:.3f} ms "
                f"({100 * row['wire_under_forward_vs_raw']:.0f}%), "
                f"gather+wire+scatter {row['end_to_end_ms']:.3f} ms; exposed after the last "
                f"layer {row['exposed_ms']:.3f} ms (sender {row['exposed_sender_ms']:.3f}); "
                f"forward {row['forward_ms']:.1f} ms",
                flush=True,
            )
    args.compute = args.compute.value
    return save_run("kv_transfer", args, rows, argv)


if __name__ == "__main__":
    main()
