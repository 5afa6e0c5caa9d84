"""Gathering a request's blocks out of a paged KV cache and scattering them back in.

The cache is one tensor ``[2, num_layers, num_blocks, block_size, kv_heads, head_dim]``;
one ``index_select`` / ``index_copy_`` on the block dimension moves every layer's
K and V of any number of blocks in a single kernel.
"""

from __future__ import annotations

import math

import torch


def gather_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """``[2, num_layers, len(block_ids), block_size, kv_heads, head_dim]``, contiguous."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    return kv_cache.index_select(2, idx)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
    """Write ``gather_blocks``'s layout (or its raw bytes) into these blocks."""
    shape = (*kv_cache.shape[:2], len(block_ids), *kv_cache.shape[3:])
    if data.dtype != kv_cache.dtype:
        data = data.view(kv_cache.dtype)
    if data.numel() != math.prod(shape):
        raise ValueError(f"KV payload has {data.numel()} elements, {math.prod(shape)} expected")
    idx = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    kv_cache.index_copy_(2, idx, data.view(shape))
