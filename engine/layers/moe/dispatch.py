"""Which experts each token goes to, and the pairs grouped by expert: Triton kernels.

A decode step runs the MoE layer for a few hundred tokens, so its cost is
as much the number of launches as the work: torch's softmax / top-k /
renormalise and a sort-based grouping take some 35 small kernels a layer.
Here they are four launches (plus two fills):

- ``fused_topk``: one program per token: softmax over the router logits in
  fp32, the k largest (ties to the lower expert id, as torch.topk), the
  weights renormalised where the family does;
- ``moe_align``: count the pairs per expert (atomics), then one program turns
  the counts into each expert's padded run of whole ``BLOCK_M`` tiles and
  each tile's expert, then every pair claims a row of its expert's run
  (atomics again). Rows within an expert's run are in no particular order;
  each pair's result goes to its own output row, so the output does not
  depend on it.

Torch equivalents (``routing.select_experts``, ``reference.moe_align_reference``)
are the CPU path and the tests' oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,  # TOP_K rounded up to a power of two
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(mask, p, -1.0)
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        # The lowest id among equal maxima, as torch.topk picks.
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)
        top_w = tl.where(offs_k == j, best, top_w)
        top_i = tl.where(offs_k == j, idx, top_i)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    k_mask = offs_k < TOP_K
    tl.store(weights_ptr + row * TOP_K + offs_k, top_w, mask=k_mask)
    tl.store(ids_ptr + row * TOP_K + offs_k, top_i, mask=k_mask)


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]), as routing.select_experts."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _topk_kernel[(num_tokens,)](
            router_logits,
            weights,
            ids,
            num_experts,
            router_logits.stride(0),
            TOP_K=top_k,
            RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k),
        )
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    e = tl.where(e < 0, num_experts, e)  # held elsewhere: the last bucket
    tl.atomic_add(counts_ptr + e, 1, mask=mask)


@triton.jit
def _runs_kernel(
    counts_ptr,
    cursors_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_experts,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # >= num_experts + 1
    BLOCK_T: tl.constexpr,
):
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e <= num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursors_ptr + offs_e, ends - padded, mask=offs_e <= num_experts)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    ends = tl.where(offs_e <= num_experts, ends, 2147483647)
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        # A tile's bucket: how many runs end at or before its first row.
        bucket = tl.sum((ends[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32), 1)
        expert = tl.where(bucket < num_experts, bucket, -1)
        tl.store(expert_ids_ptr + tiles, expert, mask=tiles < num_tiles)


@triton.jit
def _place_kernel(
    ids_ptr, cursors_ptr, sorted_ids_ptr, num_pairs, num_experts, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=mask, other=0)
    e = tl.where(e < 0, num_experts, e)
    row = tl.atomic_add(cursors_ptr + e, 1, mask=mask)
    tl.store(sorted_ids_ptr + row, offs, mask=mask)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids [EM] int32, expert of each BLOCK_M tile int32 (-1: write
    zeros), padded pair count [1] int32) for ids [T, k] (-1: an expert held
    elsewhere); EM is the worst case, ``T*k + (E+1)*(BLOCK_M-1)`` rounded up to
    whole tiles, and padding entries hold ``T * k``."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    num_tiles = triton.cdiv(num_pairs + (num_experts + 1) * (block_m - 1), block_m)
    sorted_ids = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    scratch = torch.zeros(2, num_experts + 1, dtype=torch.int32, device=device)
    counts, cursors = scratch[0], scratch[1]
    block = 1024
    grid = (max(1, triton.cdiv(num_pairs, block)),)
    _count_kernel[grid](ids, counts, num_pairs, num_experts, BLOCK=block)
    _runs_kernel[(1,)](
        counts,
        cursors,
        expert_ids,
        num_padded,
        num_experts,
        num_tiles,
        BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts + 1),
        BLOCK_T=64,
    )
    _place_kernel[grid](ids, cursors, sorted_ids, num_pairs, num_experts, BLOCK=block)
    return sorted_ids, expert_ids, num_padded
