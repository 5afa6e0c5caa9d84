"""The experts in plain torch: the CPU path and the oracle of the fused kernel
(and, for the tests, the pairs' grouping by expert in torch ops).

Hugging Face's loop, in its order of operations (so fp32 runs match it): for
each expert that some token chose, its tokens' gate/up projection, the
activation, the down projection, scaled by the routing weight and added into
the token's output. The loop reads which experts were chosen on the host (a
device sync per layer): fine on a CPU, not for CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def reference_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k]: local expert ids, -1 for experts held elsewhere
    act: nn.Module,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    ids = topk_ids.long()
    hit = torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist()
    for e in hit:
        token, slot = torch.where(ids == e)
        h = act(F.linear(x[token], w13[e]))
        h = F.linear(h, w2[e]) * topk_weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out


def moe_align_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dispatch.moe_align in torch ops (a sort; pairs in order within an expert)."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    buckets = num_experts + 1  # the last: experts held elsewhere
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)
    counts = torch.zeros(buckets, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first_padded = ends - padded
    first_raw = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    bucket = flat[order]
    dest = first_padded[bucket] + torch.arange(num_pairs, device=device) - first_raw[bucket]
    max_len = num_pairs + buckets * (block_m - 1)
    num_tiles = -(-max_len // block_m)
    sorted_ids = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(num_tiles, device=device) * block_m
    tile_bucket = torch.searchsorted(ends, tile_start, right=True)
    expert_ids = torch.where(tile_bucket < num_experts, tile_bucket, -1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)
