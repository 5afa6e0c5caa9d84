"""The skinny GEMM's Triton kernels (engine/layers/skinny_gemm.py says what and why)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.specs import GemvConfig


@triton.jit
def _load_tile(w_ptrs, x_ptrs, k, k_end, offs_k, n_mask, m_mask, EVEN_K: tl.constexpr):
    """One BLOCK_K-wide tile of the weight rows and of the token rows."""
    if EVEN_K:
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
    else:
        k_mask = (k + offs_k) < k_end
        w = tl.load(
            w_ptrs,
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    return w, x


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    part_ptr,  # [SPLIT_K, M, N] fp32 partial sums (SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of BLOCK_K * SPLIT_K: no K masks
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # This program's share of K, in whole tiles.
    tiles = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_start = pid_k * tiles * BLOCK_K
    k_end = tl.minimum(K, k_start + tiles * BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_DOT:
        # Triton's pipeliner keeps num_stages tiles of a dot's operands in flight.
        for k in range(k_start, k_end, BLOCK_K):
            w, x = _load_tile(w_ptrs, x_ptrs, k, k_end, offs_k, n_mask, m_mask, EVEN_K)
            acc += tl.dot(x, tl.trans(w))
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
    else:
        # It does not pipeline loads that feed no dot: prefetch by hand, so the
        # next tile's load is in flight while this one's FMAs run. (An empty
        # split's first load is all masked: it adds zeros.)
        w, x = _load_tile(w_ptrs, x_ptrs, k_start, k_end, offs_k, n_mask, m_mask, EVEN_K)
        for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_next, x_next = _load_tile(w_ptrs, x_ptrs, k, k_end, offs_k, n_mask, m_mask, EVEN_K)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
            w, x = w_next, x_next
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the sum is deterministic
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel; x: [..., K] with at most MAX_M rows."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    block_m = max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m)
    part = (
        torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
        if cfg.split_k > 1
        else out
    )
    bias_arg = bias if bias is not None else out
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n), cfg.split_k)](
        x2,
        weight,
        bias_arg,
        out,
        part,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        USE_DOT=cfg.use_dot,
        EVEN_K=k % (cfg.block_k * cfg.split_k) == 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(triton.cdiv(n, block), m)](
            part,
            bias_arg,
            out,
            m,
            n,
            out.stride(0),
            HAS_BIAS=bias is not None,
            SPLIT_K=cfg.split_k,
            BLOCK=block,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], n)
