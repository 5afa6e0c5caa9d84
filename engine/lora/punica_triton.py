"""The punica shrink / expand as Triton kernels (CUDA; engine/lora/punica.py
has the contract and the torch reference).

One program per (token, output tile), reading the token's slot from the
device: the launch depends on no host value but the shapes, so a CUDA graph
can replay it with new slots in its input buffer. A token of slot -1 writes
zeros (shrink) or nothing (expand). Products accumulate in fp32.

Per token, each program reads its slot's whole A (or B tile): right for
decode steps, where a slot's weights are read once per token anyway; a long
prefill reads them once per token too (from L2, the slots being small), where
a segment-grouped kernel (punica's sgmv: a tile of one slot's tokens per
program, tensor-core dots) would read them once per tile. Not done yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, u_ptr, K, R,
    stride_xt, stride_al, stride_ar, stride_ut,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
            a_ptrs = a_ptr + slot * stride_al + r[:, None] * stride_ar + k[None, :]
            a = tl.load(a_ptrs, mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(u_ptr + t * stride_ut + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(
    u_ptr, b_ptr, slots_ptr, y_ptr, N, R, offset,
    stride_ut, stride_bl, stride_bn, stride_yt,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            u = tl.load(u_ptr + t * stride_ut + r, mask=r < R, other=0.0)
            b_ptrs = b_ptr + slot * stride_bl + n[:, None] * stride_bn + r[None, :]
            b = tl.load(b_ptrs, mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
            acc += tl.sum(b.to(tl.float32) * u[None, :], axis=1)
        y_ptrs = y_ptr + t * stride_yt + offset + n
        y = tl.load(y_ptrs, mask=n < N, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n < N)


def shrink_triton(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, k = x.shape
    r = a.shape[1]
    u = torch.empty(num_tokens, r, dtype=torch.float32, device=x.device)
    block_r = min(max(triton.next_power_of_2(r), 16), 64)
    grid = (num_tokens, triton.cdiv(r, block_r))
    _shrink_kernel[grid](
        x, a, token_slots, u, k, r, x.stride(0), a.stride(0), a.stride(1), u.stride(0),
        BLOCK_R=block_r, BLOCK_K=128,
    )  # fmt: skip
    return u


def expand_triton(
    y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, offset: int
) -> None:
    num_tokens = y.shape[0]
    n, r = b.shape[1], b.shape[2]
    if u.stride(-1) != 1:
        u = u.contiguous()
    block_r = min(max(triton.next_power_of_2(r), 16), 64)
    grid = (num_tokens, triton.cdiv(n, 64))
    _expand_kernel[grid](
        u, b, token_slots, y, n, r, offset, u.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_N=64, BLOCK_R=block_r,
    )  # fmt: skip
