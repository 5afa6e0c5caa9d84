"""The fused MoE layer's Triton kernel: every expert's projection in one launch.

The design of vLLM's and SGLang's fused_moe. Each token chose ``k`` experts,
so there are ``T * k`` (token, slot) pairs. ``moe_align`` (dispatch.py)
groups the pairs by expert and pads each expert's run to a multiple of
``BLOCK_M``, so that every ``BLOCK_M``-row tile of the list belongs to one
expert. The kernel gives each program one such tile and ``BLOCK_N`` output
columns: it gathers the tile's input rows, multiplies them by that expert's
weight, and scatters the result to the pairs' rows. Two launches make an expert MLP: gate/up
(``[T*k, 2I]``), then, after SiLU-and-mul, down with the routing weight
applied (``[T*k, H]``); a sum over the ``k`` slots gives each token's output.

CUDA-graph safe: nothing is read back to the host. The sorted list has its
worst-case length, ``T*k + (E+1)*(BLOCK_M-1)``; tiles past the padded total
(read on the device) return at once. Ids of experts this rank does not hold
(-1: expert parallelism, later) go to a last bucket whose tiles write zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.moe.configs import MoeKernelConfig
from engine.layers.moe.dispatch import moe_align


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows, K] inputs: tokens (gate/up, A_PER_PAIR=False) or pairs (down)
    b_ptr,  # [E, N, K] expert weights
    c_ptr,  # [T * k, N] outputs, one row per pair
    topk_weights_ptr,  # [T * k] fp32
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    top_k: tl.constexpr,
    A_PER_PAIR: tl.constexpr,  # a's rows are pairs (down) rather than tokens
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact products (no TF32), as the reference
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Programs in groups of GROUP_M tiles sharing the same columns, so that a
    # group's weight tiles stay in L2 (the tiles of one expert are adjacent).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.num_programs(0), tl.cdiv(N, BLOCK_N))
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    pair_mask = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    c_mask = pair_mask[:, None] & (offs_n[None, :] < N)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert == -1:  # held by another rank: this rank adds nothing
        tl.store(c_ptrs, tl.zeros([BLOCK_M, BLOCK_N], dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    rows = pairs if A_PER_PAIR else pairs // top_k
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    # Columns past N wrap around (loaded, never stored): no mask on the weight.
    b_ptrs = (
        b_ptr + expert * stride_be + (offs_n % N)[None, :] * stride_bn + offs_k[:, None] * stride_bk
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=pair_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def invoke_fused_moe(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    per_pair: bool,
    mul_routed_weight: bool,
    config: MoeKernelConfig,
) -> None:
    """``out[pair] = a[row of pair] @ w[expert of pair].T`` (times the routing
    weight), over the sorted pairs ``align`` (``moe_align``'s result)."""
    sorted_ids, expert_ids, num_padded = align
    n, k = w.shape[1:]
    if a.stride(1) != 1 or w.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("fused MoE: inputs, weights and outputs need contiguous rows")
    grid = (expert_ids.shape[0] * triton.cdiv(n, config.block_n),)
    _fused_moe_kernel[grid](
        a,
        w,
        out,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_padded,
        n,
        k,
        topk_weights.numel(),
        a.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        top_k=top_k,
        A_PER_PAIR=per_pair,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        EVEN_K=k % config.block_k == 0,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int32 local expert ids (-1: held elsewhere)
    config: MoeKernelConfig,
    act,  # [pairs, 2I] -> [pairs, I] (SiLU-and-mul)
) -> torch.Tensor:
    """The routed experts' output [T, H] (this rank's share of it under tensor parallelism)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    align = moe_align(topk_ids, w13.shape[0], config.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    invoke_fused_moe(x, w13, gate_up, weights, align, top_k, False, False, config)
    h = act(gate_up)
    down = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    invoke_fused_moe(h, w2, down, weights, align, top_k, True, True, config)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
