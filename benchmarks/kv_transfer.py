"""KV transfer between two GPUs: pdserve's path against raw NCCL send/recv of the same bytes.

    python benchmarks/kv_transfer.py                    # Llama-3.1-8B shape, 512/2048/8192 tokens

Two processes, one GPU each. Each holds a paged KV cache of the shape's layout.
pdserve's path is what the nodes run: the prefill side gathers the request's
blocks into one buffer and its KVSender sends header + payload over the pair
channel; the decode side's KVReceiver receives and scatters them into other,
random blocks. "End to end" is from the gather's start to the scatter's end (same
host clock); "wire" is the sender's send alone. The baseline is one NCCL
send/recv of a buffer of the same size between the same two processes.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run
from engine.models.shapes import SHAPES


def cache_shape(shape: str, num_blocks: int, block_size: int) -> tuple[int, ...]:
    cfg = SHAPES[shape]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return (
        2,
        cfg["num_hidden_layers"],
        num_blocks,
        block_size,
        cfg["num_key_value_heads"],
        head_dim,
    )


def worker(rank: int, args: argparse.Namespace, store_port: int, raw_port: int, results) -> None:
    import datetime
    import random

    import torch
    import torch.distributed as dist

    from common.kv_transfer import Destination, KVReceiver, KVSender, TransferHeader
    from engine.kv_blocks import gather_blocks, scatter_blocks

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    sizes = [int(t) for t in args.tokens.split(",")]
    bs = args.block_size
    max_blocks = max(-(-t // bs) for t in sizes)
    cache = torch.randn(
        cache_shape(args.shape, 2 * max_blocks, bs), dtype=torch.bfloat16, device=device
    )
    rng = random.Random(rank)
    out: dict[str, Any] = {"rank": rank, "raw": {}, "ours": {}}

    # ---- raw NCCL baseline: one send/recv of a same-size buffer.
    raw_store = dist.TCPStore(
        "127.0.0.1",
        raw_port,
        is_master=(rank == 1),
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    raw = dist.ProcessGroupNCCL(dist.PrefixStore("raw", raw_store), rank, 2)
    for tokens in sizes:
        nblocks = -(-tokens // bs)
        nbytes = cache[:, :, :nblocks].numel() * 2
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        times = []
        for i in range(args.warmup + args.iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            work = raw.send([buf], 1, 0) if rank == 0 else raw.recv([buf], 0, 0)
            work.wait()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        out["raw"][tokens] = {"bytes": nbytes, "seconds": sorted(times)[len(times) // 2]}

    # ---- pdserve's path: gather -> KVSender -> KVReceiver -> scatter.
    if rank == 1:
        landed: queue.Queue = queue.Queue()

        def on_transfer(peer, header, payload, stream):
            nblocks = header.num_blocks
            dst = rng.sample(range(cache.shape[2]), nblocks)
            with torch.cuda.stream(stream):
                scatter_blocks(cache, dst, payload)
            stream.synchronize()
            landed.put((header.reservation_id, time.time()))

        receiver = KVReceiver(
            "decode-bench",
            "127.0.0.1",
            store_port,
            device,
            on_transfer,
            lambda peer, e: landed.put(("failed", str(e))),
            timeout_s=60,
            first_epoch=0,  # the sender process names epoch 0
        )
        for i in range(len(sizes) * (args.warmup + args.iters)):
            receiver.expect("prefill-bench", i + 1)  # the sender numbers them from 1
        ends = {}
        for _ in range(len(sizes) * (args.warmup + args.iters)):
            rid, t = landed.get(timeout=300)
            ends[rid] = t
        out["landed"] = ends
        receiver.close()
    else:
        sender = KVSender("prefill-bench", device, timeout_s=60)
        dest = Destination("decode-bench", "127.0.0.1", store_port, 0)
        starts, wires = {}, {}
        rid = 0
        for tokens in sizes:
            nblocks = -(-tokens // bs)
            for _ in range(args.warmup + args.iters):
                rid += 1
                src = rng.sample(range(cache.shape[2]), nblocks)
                torch.cuda.synchronize()
                starts[rid] = (tokens, time.time())
                payload = gather_blocks(cache, src)
                ready = torch.cuda.Event()
                ready.record()
                header = TransferHeader(rid, nblocks, payload.numel() * 2, 0)
                wires[rid] = sender.submit(dest, header, payload, ready).result(timeout=120)
                time.sleep(0.01)  # let the receiver finish before the next one starts
        out["starts"] = starts
        out["wire"] = wires
        sender.close()
    results.put(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from pdserve.redis_server import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="512,2048,8192")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit("kv_transfer.py needs two CUDA GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store_port, raw_port = free_port(), free_port()
    procs = [
        ctx.Process(target=worker, args=(r, args, store_port, raw_port, results)) for r in (1, 0)
    ]
    for proc in procs:
        proc.start()
    outs = {o["rank"]: o for o in (results.get(timeout=600) for _ in procs)}
    for proc in procs:
        proc.join(60)
    sender, receiver = outs[0], outs[1]
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        raw = sender["raw"][tokens]
        ids = [rid for rid, (t, _) in sender["starts"].items() if t == tokens][args.warmup :]
        e2e = sorted(receiver["landed"][rid] - sender["starts"][rid][1] for rid in ids)
        wire = sorted(sender["wire"][rid] for rid in ids)
        e2e_s, wire_s = e2e[len(e2e) // 2], wire[len(wire) // 2]
        row = {
            "tokens": tokens,
            "bytes": raw["bytes"],
            "raw_nccl_ms": raw["seconds"] * 1e3,
            "raw_nccl_GBps": raw["bytes"] / raw["seconds"] / 1e9,
            "wire_ms": wire_s * 1e3,
            "wire_GBps": raw["bytes"] / wire_s / 1e9,
            "end_to_end_ms": e2e_s * 1e3,
            "end_to_end_GBps": raw["bytes"] / e2e_s / 1e9,
            "wire_vs_raw": raw["seconds"] / wire_s,
            "end_to_end_vs_raw": raw["seconds"] / e2e_s,
        }
        rows.append(row)
        print(
            f"{tokens:5d} tokens ({raw['bytes'] / 2**20:.0f} MiB): raw NCCL {row['raw_nccl_ms']:.3f} ms "
            f"({row['raw_nccl_GBps']:.0f} GB/s); pdserve wire {row['wire_ms']:.3f} ms "
            f"({100 * row['wire_vs_raw']:.0f}% of raw), gather+send+recv+scatter {row['end_to_end_ms']:.3f} ms "
            f"({100 * row['end_to_end_vs_raw']:.0f}% of raw)",
            flush=True,
        )
    return save_run("kv_transfer", args, rows, argv)


if __name__ == "__main__":
    main()
