"""What a streamed KV send costs the forward beside it: NCCL send kernels against copy-engine copies.

    python benchmarks/kv_send_paths.py --tokens 2048 --layers-per-chunk 1,4
    NCCL_MIN_P2P_NCHANNELS=32 python benchmarks/kv_send_paths.py --label min-p2p-32

Two GPUs of one host, two processes (rank 0 on GPU 0 prefills, rank 1 on
GPU 1 receives). Rank 0 runs a synthetic Llama-shaped forward (each layer's
own matmuls and causal attention for the prompt, ``kv_stream_worker.layer_fn``)
and, after every ``--layers-per-chunk`` layers, gathers those layers' KV out of
a paged cache on the engine's stream, as prefill_node/kv_stream.py does, then
moves the chunk to GPU 1 on a transfer stream ordered after the gather by an
event. Ways of moving it (``--modes``, interleaved iteration by iteration so a
drift of the GPUs falls on all alike):

- ``none``: the forward alone (the baseline);
- ``gather``: the gathers, no transfer;
- ``nccl``: an NCCL send per chunk (rank 1 posts the matching receives ahead,
  as the decode node does once a step's headers arrived): the path pdserve
  uses. Its send kernel holds SMs while the next layers' matmuls run;
- ``ce``: a peer copy per chunk into a buffer on GPU 1 (``cudaMemcpyAsync``
  issued on GPU 0: its copy engines, no SMs). The buffer is rank 0's own: the
  same copy into a buffer rank 1 shared through CUDA IPC is timed beside it
  (pushed, issued on GPU 0; and pulled, issued on GPU 1, whose memory it is),
  as the whole payload only.

Per way: the forward's device time (events on the engine's stream) and what it
adds to ``none``'s; the chunks' time on the transfer stream, summed; what is
left after the last layer (its end to the last chunk's end). Without compute:
the chunks back to back, and one message of the whole payload (the raw figure
the wire is compared with). NCCL settings come from the environment (the
record keeps every ``NCCL_*`` variable): run the script once per setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import enable_peer_copies, rotated, save_run
from benchmarks.kv_stream_worker import geometry, layer_fn, pair_store, report
from engine.models.shapes import SHAPES
from prefill_node.kv_plan import layer_spans

MODES = ("none", "gather", "nccl", "ce")
TRANSFERS = ("nccl", "ce")


def chunk_layers(num_layers: int, lpc: int, last_layers: int = 0) -> list[tuple[int, int]]:
    """The layer ranges sent as one chunk each, as the prefill node's streamer
    cuts them (``--kv-stream-layers``, ``--kv-stream-last-layers``)."""
    return [
        (s, min(s + per, end))
        for start, end, per in layer_spans(num_layers, lpc, last_layers)
        for s in range(start, end, per)
    ]


def variants(a: dict[str, Any]) -> list[tuple[int, int]]:
    """(layers per chunk, last layers) pairs to run, without repeats."""
    out = []
    for lpc in _ints(a["layers_per_chunk"]):
        for last in _ints(a["last_layers"]):
            if last == 0 or lpc < a["num_layers"]:
                out.append((lpc, last))
    return out


def nccl_messages(a: dict[str, Any], g: dict[str, int]) -> list[int]:
    """Every NCCL message rank 0 sends, in order, in bytes: rank 1 posts the
    same receives. The order is ``_sender``'s."""
    msgs: list[int] = []
    for tokens in _ints(a["tokens"]):
        per_layer = _layer_bytes(a, g, tokens)
        for lpc, last in variants(a):
            sizes = [(e - s) * per_layer for s, e in chunk_layers(g["layers"], lpc, last)]
            for _ in range(a["warmup"] + a["iters"]):
                for mode in a["modes"]:
                    if mode == "nccl":
                        msgs += sizes
            if "nccl" in a["modes"]:
                for _ in range(a["warmup"] + a["iters"]):
                    msgs += sizes  # back to back, no compute
                    msgs.append(sum(sizes))  # the whole payload as one message
    return msgs


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",")]


def _layer_bytes(a: dict[str, Any], g: dict[str, int], tokens: int) -> int:
    blocks = -(-tokens // a["block_size"])
    return 2 * blocks * a["block_size"] * g["kv_heads"] * g["head_dim"] * 2  # K and V, bf16


def run_rank(rank: int, a: dict[str, Any], port: int, queues) -> None:
    results, handles = queues
    report(results, rank, lambda: _run(rank, a, port, handles))


def _run(rank: int, a: dict[str, Any], port: int, handles) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    g = geometry(a["shape"])
    store = pair_store(rank, port, 300)
    opts = dist.ProcessGroupNCCL.Options()
    # Rank 1 posts every receive of the run at once: NCCL's watchdog (10 minutes
    # by default) must not time the last of them out on a long run.
    opts._timeout = datetime.timedelta(hours=2)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("paths", store), rank, 2, opts)
    largest = max(_layer_bytes(a, g, t) for t in _ints(a["tokens"])) * g["layers"]
    if rank == 1:
        shared = torch.empty(largest, dtype=torch.uint8, device="cuda:1")
        handles.put(shared)  # rank 0 times one copy into it through CUDA IPC
        buf = torch.empty(largest, dtype=torch.uint8, device="cuda:1")
        for nbytes in nccl_messages(a, g):
            pg.recv([buf[:nbytes]], 0, 0).wait()
        torch.cuda.synchronize()
        store.wait(["done"])
        return {"rank": 1}
    shared = handles.get(timeout=300)
    enable_peer_copies()
    try:
        landing = torch.empty(largest, dtype=torch.uint8, device="cuda:1")
        return {"rank": 0, "rows": _sender(a, g, pg, landing, shared)}
    finally:
        del shared
        torch.cuda.synchronize()
        store.set("done", "1")


def _sender(a: dict[str, Any], g: dict[str, int], pg, landing, shared) -> list[dict[str, Any]]:
    import torch

    dev = torch.device("cuda", 0)
    bs = a["block_size"]
    compute, xfer = torch.cuda.current_stream(), torch.cuda.Stream(dev)
    rows = []
    sent: list[int] = []  # every NCCL message's size, checked against rank 1's receives
    for tokens in _ints(a["tokens"]):
        nb = -(-tokens // bs)
        cache = torch.randn(
            (2, g["layers"], 2 * nb, bs, g["kv_heads"], g["head_dim"]),
            dtype=torch.bfloat16,
            device=dev,
        )
        blocks = torch.randperm(2 * nb, device=dev)[:nb]
        layer = layer_fn({"compute": "shape"}, g, tokens, dev)
        per_layer = _layer_bytes(a, g, tokens)

        def send(mode: str, data: torch.Tensor, offset: int) -> None:
            flat = data.view(-1).view(torch.uint8)
            if mode == "nccl":
                sent.append(flat.numel())
                pg.send([flat], 1, 0).wait()  # the stream (not the host) waits
            else:
                landing[offset : offset + flat.numel()].copy_(flat, non_blocking=True)

        for lpc, last in variants(a):
            ranges = chunk_layers(g["layers"], lpc, last)
            samples: dict[str, list[dict[str, float]]] = {m: [] for m in a["modes"]}
            modes = a["modes"]
            for it in range(a["warmup"] + a["iters"]):
                for mode in rotated(modes, it):  # each mode first as often as the others
                    torch.cuda.synchronize()
                    time.sleep(a["gap_ms"] / 1e3)  # the links idle again (nvlink_power.py)
                    t = _forward(mode, layer, cache, blocks, ranges, g, compute, xfer, send)
                    if it >= a["warmup"]:
                        samples[mode].append(t)
            bare = {
                m: _bare(m, cache, blocks, ranges, xfer, send, a)
                for m in TRANSFERS
                if m in a["modes"]
            }
            if "ce" in bare:
                bare["ce"].update(_ipc_copies(cache, blocks, shared, xfer, a))
            base = [s["forward_ms"] for s in samples["none"]]
            for mode in a["modes"]:
                row = {
                    "tokens": tokens,
                    "layers_per_chunk": lpc,
                    "last_layers": last,
                    "mode": mode,
                    "bytes": per_layer * g["layers"],
                }
                for key in ("forward_ms", "wire_ms", "exposed_ms"):
                    row[key] = statistics.median(s[key] for s in samples[mode])
                # Paired: each forward against the baseline's of the same round.
                row["forward_added_ms"] = statistics.median(
                    s["forward_ms"] - b for s, b in zip(samples[mode], base, strict=True)
                )
                if mode in bare:
                    row.update(bare[mode])
                    row["wire_vs_raw"] = row["raw_ms"] / row["wire_ms"]
                rows.append(row)
                _print(row)
        del cache
    if sent != nccl_messages(a, g):
        raise RuntimeError("the NCCL sends were not the receives rank 1 posted")
    return rows


def _forward(mode, layer, cache, blocks, ranges, g, compute, xfer, send) -> dict[str, float]:
    """One synthetic forward with this mode's chunks; device times in ms."""
    import torch

    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    start, end = ev(), ev()
    spans: list[tuple[Any, Any]] = []
    start.record(compute)
    chunk = 0
    offset = 0
    for n in range(g["layers"]):
        layer()
        if n == g["layers"] - 1:
            end.record(compute)  # the last layer's end (its chunk's gather is after it)
        if mode == "none" or n + 1 != ranges[chunk][1]:
            continue
        data = cache[:, ranges[chunk][0] : ranges[chunk][1]].index_select(2, blocks)
        chunk += 1
        if mode == "gather":
            continue
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(xfer):
            xfer.wait_event(ready)
            s, e = ev(), ev()
            s.record()
            data.record_stream(xfer)
            send(mode, data, offset)
            e.record()
        spans.append((s, e))
        offset += data.numel() * data.element_size()
    torch.cuda.synchronize()
    out = {"forward_ms": start.elapsed_time(end), "wire_ms": 0.0, "exposed_ms": 0.0}
    if spans:
        out["wire_ms"] = sum(s.elapsed_time(e) for s, e in spans)
        out["exposed_ms"] = max(0.0, end.elapsed_time(spans[-1][1]))
    return out


def _timed(stream, fn) -> float:
    """One call of ``fn`` on ``stream``, both GPUs idle first: its device time in ms."""
    import torch

    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        s.record()
        fn()
        e.record()
    e.synchronize()
    return s.elapsed_time(e)


def _bare(mode, cache, blocks, ranges, xfer, send, a) -> dict[str, float]:
    """No compute: every chunk gathered and sent back to back (first start to
    last end), and the whole payload as one message (the raw figure)."""
    import torch

    chunks = [cache[:, s:e].index_select(2, blocks) for s, e in ranges]
    whole = torch.cat([c.view(-1) for c in chunks])

    def send_all(target: list) -> None:
        offset = 0
        for c in target:
            send(mode, c, offset)
            offset += c.numel() * c.element_size()

    backs, raws = [], []
    for it in range(a["warmup"] + a["iters"]):
        for target, times in ((chunks, backs), ([whole], raws)):
            t = _timed(xfer, lambda target=target: send_all(target))
            if it >= a["warmup"]:
                times.append(t)
    return {"chunks_back_to_back_ms": statistics.median(backs), "raw_ms": statistics.median(raws)}


def _ipc_copies(cache, blocks, shared, xfer, a) -> dict[str, float]:
    """The whole payload copied through CUDA IPC (ms), ``shared`` being rank 1's
    buffer on GPU 1: pushed into it (the copy issued on GPU 0, as the ``ce``
    mode's) and pulled out of it (issued on a stream of GPU 1, whose memory it
    is, into GPU 0's)."""
    import torch

    whole = cache[:, :].index_select(2, blocks).view(-1).view(torch.uint8)
    n = whole.numel()
    with torch.cuda.device(1):
        gpu1 = torch.cuda.Stream(1)

    def push() -> None:
        shared[:n].copy_(whole, non_blocking=True)

    def pull() -> None:
        whole.copy_(shared[:n], non_blocking=True)  # torch copies on the source's device

    out = {}
    for key, fn, stream in (("raw_ipc_push_ms", push, xfer), ("raw_ipc_pull_ms", pull, gpu1)):
        times = [_timed(stream, fn) for _ in range(a["warmup"] + a["iters"])]
        out[key] = statistics.median(times[a["warmup"] :])
    return out


def _print(row: dict[str, Any]) -> None:
    text = (
        f"{row['tokens']:5d} tokens, {row['layers_per_chunk']} layer(s)/chunk, last "
        f"{row['last_layers']} streamed, {row['mode']:6s}: "
        f"forward {row['forward_ms']:.3f} ms ({row['forward_added_ms']:+.3f}), "
        f"wire {row['wire_ms']:.3f} ms, exposed {row['exposed_ms']:.3f} ms"
    )
    if "raw_ms" in row:
        text += (
            f"; no compute: chunks {row['chunks_back_to_back_ms']:.3f} ms, "
            f"whole {row['raw_ms']:.3f} ms"
        )
    if "raw_ipc_push_ms" in row:
        text += (
            f"; through CUDA IPC: pushed {row['raw_ipc_push_ms']:.3f} ms, "
            f"pulled {row['raw_ipc_pull_ms']:.3f} ms"
        )
    print(text, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from pdserve.redis_server import free_port

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="2048")
    p.add_argument("--layers-per-chunk", default="1,4")
    p.add_argument(
        "--last-layers", default="0", help="values to compare: only the last N layers streamed"
    )
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--gap-ms",
        type=float,
        default=300.0,
        help="idle before each forward: NVLink stays in its active power state some 50 ms "
        "after a transfer, which slows a power-capped GPU's next forward too",
    )
    p.add_argument("--label", default="", help="a name for this run's settings, kept in the record")
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "none" not in modes:
        raise SystemExit(f"--modes: one or more of {', '.join(MODES)}, with none (got {modes})")
    if torch.cuda.device_count() < 2:
        raise SystemExit("kv_send_paths.py needs two GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    args.nccl_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    a = {**vars(args), "modes": modes, "out_dir": None}
    a["num_layers"] = SHAPES[args.shape]["num_hidden_layers"]
    ctx = mp.get_context("spawn")
    results, handles = ctx.Queue(), ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, a, port, (results, handles))) for r in (1, 0)]
    for proc in procs:
        proc.start()
    outs: dict[int, dict[str, Any]] = {}
    try:
        while len(outs) < len(procs):
            o = results.get(timeout=1800)
            outs[o["rank"]] = o
            if "error" in o:  # the other rank would wait for it forever
                raise SystemExit(f"rank {o['rank']} failed: {o['error']}")
    finally:
        for proc in procs:
            proc.join(60 if len(outs) == len(procs) else 0)
            if proc.is_alive():
                proc.kill()
    return save_run("kv_send_paths", args, outs[0]["rows"], argv)


if __name__ == "__main__":
    main()
