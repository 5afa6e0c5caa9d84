"""Gathering blocks out of a paged KV cache and scattering them back in.

The cache is one tensor ``[2, num_layers, num_blocks, block_size, kv_heads, head_dim]``.
A gather or scatter names blocks and, optionally, a layer range and a KV-head
range: ``[2, layers, len(block_ids), block_size, heads, head_dim]``, contiguous.
One ``index_select`` / ``index_copy_`` on the block dimension of the (layer-
and head-sliced) view moves every K and V of any number of blocks in a single
kernel. The ranges are what a streamed transfer sends per message (a group of
layers as soon as they are computed; with tensor parallelism, only the heads a
rank holds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Range = tuple[int, int]  # [start, end)


def block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as an index tensor on ``device`` (built once, reused per range)."""
    idx = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type == "cuda":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx.to(device)


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
) -> torch.Tensor:
    """``[2, layers, len(block_ids), block_size, heads, head_dim]``, contiguous.

    ``on`` (a GPU): run the copy on that stream, into memory of the current
    stream's pool (a side stream's pool would hold its own cache of such
    buffers, memory the engine's budget does not count)."""
    view = _view(kv_cache, layers, heads)
    idx = _index(block_ids, kv_cache.device)
    if on is None:
        return view.index_select(2, idx).contiguous()
    out = view.new_empty((*view.shape[:2], idx.numel(), *view.shape[3:]))
    out.record_stream(on)
    idx.record_stream(on)
    with torch.cuda.stream(on):
        torch.index_select(view, 2, idx, out=out)
    return out


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
    view.index_copy_(2, idx, data.view(shape))
