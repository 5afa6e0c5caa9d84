"""Gathering blocks out of a paged KV cache and scattering them back in.

The cache is one tensor ``[2, num_layers, num_blocks, block_size, kv_heads, head_dim]``.
A gather or scatter names blocks and, optionally, a layer range and a KV-head
range: ``[2, layers, len(block_ids), block_size, heads, head_dim]``, contiguous.
One ``index_select`` / ``index_copy_`` on the block dimension of the (layer-
and head-sliced) view moves every K and V of any number of blocks in a single
kernel. The ranges are what a streamed transfer sends per message (a group of
layers as soon as they are computed; with tensor parallelism, only the heads a
rank holds).

On a GPU a gather beside the forward goes on the copy engines instead where
the blocks are few runs of consecutive ids (``block_runs``; copy_engine.py
says why): per run, each K or V half is one pitched copy, a row per layer
(or, where the cache's layer stride is over the driver's pitch limit, a copy
per layer).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from engine.copy_engine import CopyEngine
from engine.layers.attention.kv_quant import storage_view

logger = logging.getLogger(__name__)

Range = tuple[int, int]  # [start, end)
Run = tuple[int, int]  # (first block id, number of blocks)
# More runs than this go by kernel: each run is two driver calls on the host.
MAX_COPY_RUNS = 8
# Nor more driver calls than this for one gather (a copy per layer: 2 x layers
# per run), each some microseconds of the engine thread's time.
MAX_COPIES = 64
# A copy per layer only of runs this large: many small copies slowed the layers
# computing beside them by more than the gather kernel they replace, large ones
# by much less (docs/lab/2026-11-28-copy-engine-pitch-limit.md).
MIN_LAYER_COPY_BYTES = 4 << 20


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on ``device`` (built once, reused per range)."""
    idx = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type == "cuda":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx.to(device)


def block_runs(block_ids: Sequence[int]) -> list[Run]:
    """The ids as runs of consecutive ascending ids, in order."""
    runs: list[Run] = []
    start = prev = None
    for b in block_ids:
        if prev is not None and b == prev + 1:
            prev = b
            continue
        if start is not None:
            runs.append((start, prev - start + 1))
        start = prev = b
    if start is not None:
        runs.append((start, prev - start + 1))
    return runs


def cache_copier(kv_cache: torch.Tensor) -> CopyEngine | None:
    """The copy engines for gathers out of ``kv_cache`` (a GPU's), or None (a CPU,
    or no driver library): its rows are a layer's blocks, a layer stride apart."""
    if not kv_cache.is_cuda:
        return None
    copier = CopyEngine.load(kv_cache.device.index)
    if copier is None:
        return None
    stride = kv_cache.stride(1) * kv_cache.element_size()
    if stride > copier.max_pitch:
        logger.info(
            "KV chunks of consecutive blocks go on the copy engines a layer per copy, "
            "where a layer's run is %d bytes or more (the cache's layer stride, %d bytes, "
            "is over their pitch limit, %d)",
            MIN_LAYER_COPY_BYTES,
            stride,
            copier.max_pitch,
        )
    else:
        logger.info("KV chunks of consecutive blocks go on the copy engines")
    return copier


def kv_unit_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of one layer of one KV head, K and V: the unit of a transfer."""
    return 2 * kv_cache.shape[3] * kv_cache.shape[5] * kv_cache.element_size()


def _view(kv_cache: torch.Tensor, layers: Range | None, heads: Range | None) -> torch.Tensor:
    view = kv_cache if layers is None else kv_cache[:, layers[0] : layers[1]]
    return view if heads is None else view[:, :, :, :, heads[0] : heads[1]]


def _index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids
    return torch.tensor(list(block_ids), dtype=torch.int64, device=device)


def gather_blocks(
    kv_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    layers: Range | None = None,
    heads: Range | None = None,
    on: torch.cuda.Stream | None = None,
    runs: Sequence[Run] | None = None,
    copier: CopyEngine | None = None,
) -> torch.Tensor:
    """``[2, layers, len(block_ids), block_size, heads, head_dim]``, contiguous.

    ``on`` (a GPU): run the copy on that stream, into memory of the current
    stream's pool (a side stream's pool would hold its own cache of such
    buffers, memory the engine's budget does not count); with ``copier`` and
    the ids' ``runs`` (``block_runs``) on its copy engines where it can."""
    view = _view(kv_cache, layers, heads)
    idx = _index(block_ids, kv_cache.device)
    if on is None:
        return view.index_select(2, idx).contiguous()
    out = view.new_empty((*view.shape[:2], idx.numel(), *view.shape[3:]))
    out.record_stream(on)
    if copier is not None and runs is not None and _copy_runs(view, out, runs, copier, on):
        copier.gathers += 1
        return out
    idx.record_stream(on)
    with torch.cuda.stream(on):
        torch.index_select(view, 2, idx, out=out)
    return out


def _copy_runs(
    view: torch.Tensor,
    out: torch.Tensor,
    runs: Sequence[Run],
    copier: CopyEngine,
    on: torch.cuda.Stream,
) -> bool:
    """``gather_blocks`` by pitched copies, one per run and K/V half: a row per
    layer, the run's blocks' bytes; a copy per layer too where the layer stride
    is over the driver's pitch limit. False (for the kernel, which also fails
    loudly on ids out of range) where a block's bytes are not one contiguous
    span in the cache's order (a head range of the cache's), where there are
    too many runs (or copies), runs too short to copy a layer at a time, or
    runs that do not fit the output and the cache, or where the driver refused."""
    if len(runs) > MAX_COPY_RUNS or sum(n for _, n in runs) != out.shape[2]:
        return False
    if any(first < 0 or n < 1 or first + n > view.shape[2] for first, n in runs):
        return False
    block_elems = 1  # each block's elements contiguous, in the cache's order
    for d in range(view.dim() - 1, 2, -1):
        if view.stride(d) != block_elems:
            return False
        block_elems *= view.shape[d]
    if view.stride(2) != block_elems:
        return False
    size = view.element_size()
    block_bytes = block_elems * size
    src_base, dst_base = view.data_ptr(), out.data_ptr()
    src_pitch, dst_pitch = view.stride(1) * size, out.stride(1) * size
    layers = view.shape[1]
    # Rows a stride over the pitch limit apart: a copy per layer (one row each).
    per_layer = src_pitch > copier.max_pitch
    height = 1 if per_layer else max(layers, 1)  # rows per copy
    if per_layer and min((n for _, n in runs), default=0) * block_bytes < MIN_LAYER_COPY_BYTES:
        return False
    if len(runs) * view.shape[0] * (layers if per_layer else 1) > MAX_COPIES:
        return False
    stream = on.cuda_stream
    for half in range(view.shape[0]):
        src_half = src_base + half * view.stride(0) * size
        dst = dst_base + half * out.stride(0) * size
        for first, count in runs:
            src = src_half + first * block_bytes
            width = count * block_bytes
            # One copy of every layer's row, or one per layer (one row: its
            # pitch is only checked against the width).
            pitches = (width, width) if per_layer else (dst_pitch, src_pitch)
            for layer in range(0, layers, height):
                at, to = src + layer * src_pitch, dst + layer * dst_pitch
                if not copier.copy_2d(to, pitches[0], at, pitches[1], width, height, stream):
                    return False
            dst += width
    return True


def scatter_blocks(
    kv_cache: torch.Tensor,
    block_ids: Sequence[int] | torch.Tensor,
    data: torch.Tensor,
    layers: Range | None = None,
    heads: Range | None = None,
) -> None:
    """Write ``gather_blocks``'s layout (or its raw bytes) into these blocks."""
    idx = _index(block_ids, kv_cache.device)
    view = _view(kv_cache, layers, heads)
    shape = (*view.shape[:2], idx.numel(), *view.shape[3:])
    if data.dtype != kv_cache.dtype:
        data = data.view(kv_cache.dtype)
    if data.numel() != math.prod(shape):
        raise ValueError(f"KV payload has {data.numel()} elements, {math.prod(shape)} expected")
    storage_view(view).index_copy_(2, idx, storage_view(data).view(shape))
