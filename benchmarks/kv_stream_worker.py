"""The two processes of benchmarks/kv_transfer.py: rank 0 prefills and streams, rank 1 lands.

Rank 0 drives the prefill node's KVStreamer with a real ScheduledBatch of one
prompt (random blocks) and a synthetic forward; rank 1 runs a KVReceiver whose
sink scatters every chunk into its own cache, as the decode node's landing does,
and acknowledges each request once its last chunk is in (so that iterations do
not overlap). Both first time a raw send/recv of the same bytes.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import random
import time
import traceback
from collections.abc import Callable
from typing import Any

from engine.models.shapes import SHAPES


class Compute(enum.Enum):
    SHAPE = "shape"  # the layer's matmuls and attention for the prompt
    FIXED = "fixed"  # a matmul loop busy for --layer-ms


def geometry(shape: str) -> dict[str, int]:
    cfg = SHAPES[shape]
    heads = cfg["num_attention_heads"]
    return {
        "layers": cfg["num_hidden_layers"],
        "kv_heads": cfg["num_key_value_heads"],
        "heads": heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "hidden": cfg["hidden_size"],
        "inter": cfg["intermediate_size"],
    }


def report(results, rank: int, work: Callable[[], dict[str, Any]]) -> None:
    """Put ``work()``'s outcome on ``results``, its error too: the parent waits
    for one per rank, and must not wait forever for a rank that failed."""
    try:
        out = work()
    except BaseException as e:
        out = {"rank": rank, "error": f"{e!r}\n{traceback.format_exc()}"}
    results.put(out)


def run_rank(rank: int, a: dict[str, Any], ports: tuple[int, int], queues) -> None:
    results, acks = queues
    report(results, rank, lambda: _run(rank, a, ports, acks))


def _run(rank: int, a: dict[str, Any], ports: tuple[int, int], acks) -> dict[str, Any]:
    import torch

    cuda = a["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        # One core per process (a node each) on a small host: two OpenMP pools
        # spinning on the same cores slow every copy by orders of magnitude.
        torch.set_num_threads(a["threads"])
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    g = geometry(a["shape"])
    bs = a["block_size"]
    sizes = [int(t) for t in a["tokens"].split(",")]
    max_blocks = max(-(-t // bs) for t in sizes)
    gen = torch.Generator(device=device).manual_seed(rank)
    cache = torch.randn(
        (2, g["layers"], 2 * max_blocks, bs, g["kv_heads"], g["head_dim"]),
        generator=gen,
        dtype=torch.bfloat16,
        device=device,
    )
    out: dict[str, Any] = {"rank": rank, "raw": _raw(rank, a, ports[1], cache, sizes, bs, cuda)}
    with _traced(a.get("trace_dir"), rank, cuda):
        if rank == 0:
            out["runs"] = _prefill(a, ports[0], cache, sizes, g, device, acks)
        else:
            out["landed"] = _decode(a, ports[0], cache, sizes, device, acks)
    return out


@contextlib.contextmanager
def _traced(trace_dir: str | None, rank: int, cuda: bool):
    """With ``trace_dir``: the streamed runs under torch.profiler (host ops of
    every thread, and on a GPU its kernels and copies), one Chrome trace per
    rank, gzipped: where a chunk's time goes between the hook and the wire."""
    if not trace_dir:
        yield
        return
    import gzip
    import os
    import shutil

    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # the sender's and receiver's own threads too, not only this one
        config = _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # a torch without the option: this thread's ops and every kernel
        config = None
    with profile(activities=activities, experimental_config=config) as prof:
        yield
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"kv_transfer-rank{rank}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def pair_store(rank: int, port: int, timeout_s: float):
    """The two benchmark processes' rendezvous on this host (rank 1 hosts it)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=rank == 1,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _raw(rank, a, port, cache, sizes, bs, cuda) -> dict[int, dict[str, float]]:
    """One send/recv of a buffer of the request's size, after a barrier each time."""
    import torch
    import torch.distributed as dist

    store = pair_store(rank, port, 120)
    prefixed = dist.PrefixStore("raw", store)
    if cuda:
        pg = dist.ProcessGroupNCCL(prefixed, rank, 2)
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, 2, datetime.timedelta(seconds=120))
    out = {}
    num_layers = cache.shape[1]
    for tokens in sizes:
        nbytes = cache[:, :, : -(-tokens // bs)].numel() * cache.element_size()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=cache.device)
        out[tokens] = {"bytes": nbytes}
        # One message, and the same bytes as one message per layer (all posted at once).
        for key, parts in (("seconds", [buf]), ("per_layer_seconds", buf.chunk(num_layers))):
            times = []
            for i in range(a["warmup"] + a["iters"]):
                pg.barrier().wait()
                _sync(cuda)
                t0 = time.perf_counter()
                works = [pg.send([p], 1, 0) if rank == 0 else pg.recv([p], 0, 0) for p in parts]
                for work in works:
                    work.wait()
                _sync(cuda)
                if i >= a["warmup"]:
                    times.append(time.perf_counter() - t0)
            out[tokens][key] = sorted(times)[len(times) // 2]
    return out


def layer_fn(a, g, tokens: int, device):
    """One layer's stand-in: its own matmuls and causal attention, or a busy loop."""
    import torch
    import torch.nn.functional as F

    if Compute(a["compute"]) is Compute.FIXED:
        m = torch.randn(256, 256, device=device)
        seconds = a["layer_ms"] / 1e3

        def busy() -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                torch.mm(m, m)
                _sync(device.type == "cuda")

        return busy
    h, d, nh, kvh = g["hidden"], g["head_dim"], g["heads"], g["kv_heads"]
    w = {
        "qkv": torch.randn(h, (nh + 2 * kvh) * d, device=device, dtype=torch.bfloat16) * 0.02,
        "o": torch.randn(nh * d, h, device=device, dtype=torch.bfloat16) * 0.02,
        "gu": torch.randn(h, 2 * g["inter"], device=device, dtype=torch.bfloat16) * 0.02,
        "down": torch.randn(g["inter"], h, device=device, dtype=torch.bfloat16) * 0.02,
    }
    x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)

    def layer() -> None:
        qkv = x @ w["qkv"]
        q, k, v = qkv.split([nh * d, kvh * d, kvh * d], dim=-1)
        q, k, v = (t.view(1, tokens, -1, d).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        hid = x + att.transpose(1, 2).reshape(tokens, nh * d) @ w["o"]
        gate, up = (hid @ w["gu"]).chunk(2, dim=-1)
        _ = hid + (F.silu(gate) * up) @ w["down"]

    return layer


def _prefill(a, port, cache, sizes, g, device, acks) -> dict:
    import torch

    from common.kv_transfer import Destination, KVSender
    from engine.layers.sampler import DeviceSamples
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence
    from prefill_node.kv_stream import KVStreamer

    cuda = device.type == "cuda"
    rng = random.Random(0)
    sender = KVSender("prefill-bench", device, timeout_s=120)
    dest = Destination("decode-bench", "127.0.0.1", port, 0)
    bs = a["block_size"]
    runs: dict[tuple[int, int, bool], list[dict[str, float]]] = {}
    rid = 0
    for tokens in sizes:
        layer = layer_fn(a, g, tokens, device)
        num_blocks = -(-tokens // bs)
        for lpc in [int(x) for x in a["layers_per_chunk"].split(",")]:
            streamer = KVStreamer(cache, bs, sender, lpc, last_layers=a["last_layers"])
            # Without compute (every chunk queued back to back: the wire's own
            # speed), then under the synthetic forward (what is left after it).
            for computing in (False, True):
                key = (tokens, lpc, computing)
                runs[key] = []
                for i in range(a["warmup"] + a["iters"]):
                    rid += 1
                    seq = Sequence(rid, f"r{rid}", 0, [0] * tokens, tokens, SamplingParams(), None)
                    seq.block_table = rng.sample(range(cache.shape[2]), num_blocks)
                    where = _blocks_came(dest, rid, tokens, bs)
                    ticket = streamer.open(f"r{rid}", where, time.monotonic() + 300, False)
                    _sync(cuda)
                    start = time.monotonic()
                    layer_done = streamer.begin_step(ScheduledBatch([seq], [tokens]))
                    done = None
                    for n in range(g["layers"]):
                        if computing:
                            layer()
                            if n == g["layers"] - 1:
                                if cuda:
                                    done = torch.cuda.Event()
                                    done.record()
                                else:
                                    last_layer_at = time.monotonic()
                        # As in the engine: the hook runs once the layer is
                        # queued (on a GPU, before it ran).
                        layer_done(n)
                    # The prompt's first token, sampled after the last layer as in
                    # the engine: it follows the KV on the channel.
                    first = torch.ones(1, dtype=torch.int64, device=device)
                    streamer.step_sampled(DeviceSamples(first, [None]), [0])
                    if done is not None:
                        done.synchronize()  # the host sees the last layer end
                        last_layer_at = time.monotonic()
                    elif not computing:
                        last_layer_at = time.monotonic()
                    report = ticket.done.result(timeout=300)
                    streamer.finish(f"r{rid}", dest, rid)
                    if (ack := acks.get(timeout=300)) != rid:
                        raise RuntimeError(f"request {rid}: the decode side answered {ack!r}")
                    if i >= a["warmup"]:
                        runs[key].append(
                            {
                                "rid": rid,
                                "start": start,
                                "last_layer_at": last_layer_at,
                                "forward_s": last_layer_at - start,
                                "wire_s": report.wire_s,
                                "exposed_s": report.exposed_s,
                            }
                        )
    sender.close()
    return runs


def _blocks_came(dest, rid: int, tokens: int, block_size: int):
    """A Prefill's destination whose decode node's blocks (every one of the
    prompt's) and channel came already (prefill_node/destinations.py)."""
    from prefill_node.destinations import PendingDestination
    from proto import internal_pb2

    request = internal_pb2.PrefillRequest(
        prompt_token_ids=[0] * tokens, decode_node_id=dest.node_id, reservation_id=rid
    )
    pending = PendingDestination(request, block_size)
    blocks = internal_pb2.PrefillBlocks(
        reservation_id=rid, first_block=0, num_blocks=-(-tokens // block_size)
    )
    channel = blocks.channel
    channel.node_id, channel.store_host = dest.node_id, dest.store_host
    channel.store_port, channel.epoch = dest.store_port, dest.epoch
    pending.set(blocks)
    return pending


def _decode(a, port, cache, sizes, device, acks) -> dict[int, float]:
    import torch

    from common.kv_transfer import KVReceiver
    from engine.kv_blocks import block_index, scatter_blocks

    rng = random.Random(1)
    landed: dict[int, float] = {}

    # Units still to land per reservation: a step's segments of one request
    # (a held span and a streamed one, --last-layers) land as one.
    left: dict[int, int] = {}

    class Sink:
        def on_group(self, peer, headers):
            contexts = []
            for h in headers:
                if h.is_end:
                    contexts.append(None)
                    continue
                blocks = rng.sample(range(cache.shape[2]), h.block_end - h.block_start)
                left[h.reservation_id] = left.get(h.reservation_id, 0) + sum(
                    c.units for c in h.chunks()
                )
                contexts.append((h.reservation_id, block_index(blocks, device)))
            return contexts

        def on_chunk(self, peer, ctx, desc, data, stream):
            rid, index = ctx
            scatter_blocks(cache, index, data, desc.layers, desc.heads)
            left[rid] -= desc.units
            if left[rid] == 0:
                if stream is not None:
                    stream.synchronize()  # the last scatter is done
                landed[rid] = time.monotonic()
                acks.put(rid)

        def on_first_token(self, peer, ctx, token):
            pass  # the landing's business; the wire carried it behind the KV

        def on_peer_failed(self, peer, error, epoch):
            acks.put(f"failed: {error}")

    kv_bytes = cache.numel() * cache.element_size()
    receiver = KVReceiver(
        "decode-bench", "127.0.0.1", port, device, Sink(), 120, 0, max_group_bytes=kv_bytes
    )
    runs = len(sizes) * len(a["layers_per_chunk"].split(",")) * 2
    total = runs * (a["warmup"] + a["iters"])
    for rid in range(1, total + 1):
        receiver.expect("prefill-bench", rid)  # each stream ends with its end header
    deadline = time.monotonic() + 3600
    while len(landed) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(landed) < total:
        raise RuntimeError(f"only {len(landed)} of {total} requests landed")
    if device.type == "cuda":
        torch.cuda.synchronize()
    receiver.close()
    return landed
