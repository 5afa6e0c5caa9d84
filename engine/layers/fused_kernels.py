"""Fused Triton kernels for the small per-layer ops: a decode step of a small model
is dominated by kernel count, not by work (torch runs RMSNorm as ~8 kernels, RoPE
as ~12). Each kernel here replaces a chain of torch ops with one launch and keeps
the torch ops' rounding points where they matter (residual sums, normalised
activations and products are rounded to the activation dtype as torch does).

- ``rms_norm``: optional residual add (the sum kept in the residual's dtype),
  then RMSNorm; one row per program.
- ``silu_and_mul``: SwiGLU's ``silu(gate) * up`` over the fused gate/up output.
- ``rope_qk_``: in place on the q and k views of the fused qkv output: optional
  per-head RMSNorm (Qwen3's q/k norm), then rotary embedding (neox layout),
  q and k in one launch; optionally the KV-cache store too (k after RoPE, v),
  which saves the attention backend's store launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    out_dtype = x.dtype
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        # The sum is kept in the residual's dtype (fp32 in the decoder), rounded
        # exactly as torch's `x.to(residual.dtype) + residual` is.
        total = (xf + r.to(tl.float32)).to(r.dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs, total, mask=mask)
        xf = total.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    y = (xf * tl.math.rsqrt(var + eps)).to(out_dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * stride_out + offs,
        (y.to(tl.float32) * w.to(tl.float32)).to(out_dtype),
        mask=mask,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, x + residual) — or (normed, None) without a residual. x: [rows, N]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n = x2.shape
    out = torch.empty_like(x2)
    res_out = None
    res2 = None
    if residual is not None:
        res2 = residual.reshape(-1, n)
        res_out = torch.empty_like(res2)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res2 if res2 is not None else x2,
            weight,
            out,
            res_out if res_out is not None else out,
            x2.stride(0),
            res2.stride(0) if res2 is not None else 0,
            out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 2048 else 8,
        )
    return out.view(shape), (res_out.view(shape) if res_out is not None else None)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < N
    gate = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + col, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded, as F.silu's output is
    tl.store(
        out_ptr + row * stride_out + col,
        (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
        mask=mask,
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 2048)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], n)


@triton.jit
def _norm_rope_heads(
    base, stride_head, heads, pos, cos_ptr, sin_ptr, norm_w_ptr, eps, HEAD_DIM, HALF, HAS_NORM, HB
):
    """``HB`` heads (rows past ``heads`` masked) of one token, in place: optional
    RMSNorm per head, then rotary embedding. Returns the rotated halves (as stored)."""
    offs = tl.arange(0, HALF)
    rows = tl.arange(0, HB)
    ptrs = base + rows[:, None] * stride_head + offs[None, :]
    mask = (rows < heads)[:, None]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    if HAS_NORM:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        ss = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
        inv = tl.math.rsqrt(ss / HEAD_DIM + eps)[:, None]
        w1 = tl.load(norm_w_ptr + offs).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + HALF + offs).to(tl.float32)[None, :]
        x1 = ((a * inv).to(dtype).to(tl.float32) * w1).to(dtype)
        x2 = ((b * inv).to(dtype).to(tl.float32) * w2).to(dtype)
    # cos/sin caches hold [cos(f), cos(f)] per position; the first half suffices,
    # loaded once for all the program's heads.
    cos = tl.load(cos_ptr + pos * HEAD_DIM + offs).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * HEAD_DIM + offs).to(dtype).to(tl.float32)[None, :]
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    y1 = (a * cos - b * sin).to(dtype)
    y2 = (b * cos + a * sin).to(dtype)
    tl.store(ptrs, y1, mask=mask)
    tl.store(ptrs + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HB: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
):
    # One program per (token, group of HB heads): q's groups, then k's; one launch
    # for both. A program per head was 128 elements of work, too little to hide
    # its loads' latency (docs/lab/2026-11-27-mixed-steps-side-by-side.md).
    tok = tl.program_id(0)
    group = tl.program_id(1)
    q_groups = tl.cdiv(NUM_Q_HEADS, HB)
    pos = tl.load(pos_ptr + tok)
    if group < q_groups:
        head0 = group * HB
        base = q_ptr + tok * stride_q_tok + head0 * stride_q_head
        _norm_rope_heads(
            base,
            stride_q_head,
            NUM_Q_HEADS - head0,
            pos,
            cos_ptr,
            sin_ptr,
            q_norm_ptr,
            eps,
            HEAD_DIM,
            HALF,
            HAS_NORM,
            HB,
        )
    else:
        head0 = (group - q_groups) * HB
        base = k_ptr + tok * stride_k_tok + head0 * stride_k_head
        y1, y2 = _norm_rope_heads(
            base,
            stride_k_head,
            NUM_KV_HEADS - head0,
            pos,
            cos_ptr,
            sin_ptr,
            k_norm_ptr,
            eps,
            HEAD_DIM,
            HALF,
            HAS_NORM,
            HB,
        )
        if STORE_KV:
            # The KV store folded in: these heads' rotated k and their v go to the
            # token's cache slot (slot -1: a padding row of a CUDA graph batch).
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                rows = tl.arange(0, HB)
                mask = (rows < NUM_KV_HEADS - head0)[:, None]
                offs = tl.arange(0, HALF)[None, :]
                dst = slot * stride_cache_slot + (head0 + rows)[:, None] * stride_cache_head
                tl.store(k_cache_ptr + dst + offs, y1, mask=mask)
                tl.store(k_cache_ptr + dst + HALF + offs, y2, mask=mask)
                dims = tl.arange(0, HEAD_DIM)[None, :]
                v_src = v_ptr + tok * stride_v_tok + (head0 + rows)[:, None] * stride_v_head
                v = tl.load(v_src + dims, mask=mask, other=0.0)
                tl.store(v_cache_ptr + dst + dims, v, mask=mask)


def _store_args(kv_store, k, cos_cache, positions):
    """The kernel's cache-store arguments: (v, k_cache, v_cache, slots, v's
    two strides) and the cache's strides; placeholders where it stores none."""
    if kv_store is None:
        return (k, cos_cache, cos_cache, positions, 0, 0), (0, 0)
    v, k_cache, v_cache, slots = kv_store
    if v_cache.stride()[1:] != k_cache.stride()[1:]:
        raise ValueError("k_cache and v_cache must have the same layout")
    store = (v, k_cache, v_cache, slots, v.stride(0), v.stride(1))
    return store, (k_cache.stride(1), k_cache.stride(2))


def rope_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In place: q [T, Hq, D], k [T, Hkv, D] (views with unit stride in D), in one
    launch. ``kv_store = (v, k_cache, v_cache, slot_mapping)`` also writes the
    rotated k and v into the paged cache (the attention backend's store, folded
    in; the cache is [num_blocks, block_size, Hkv, D])."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q and k are normalised together: give both norm weights or neither")
    store, cache_strides = _store_args(kv_store, k, cos_cache, positions)
    v, k_cache, v_cache, slots, stride_v_tok, stride_v_head = store
    # Up to 8 heads a program: 2 KB of bf16 q or k each, and still a few
    # programs per token for a batch-1 decode step's parallelism.
    hb = min(8, triton.next_power_of_2(max(num_q_heads, num_kv_heads)))
    groups = triton.cdiv(num_q_heads, hb) + triton.cdiv(num_kv_heads, hb)
    _rope_qk_kernel[(num_tokens, groups)](
        q,
        k,
        v,
        positions,
        cos_cache,
        sin_cache,
        q_norm_weight if q_norm_weight is not None else cos_cache,
        k_norm_weight if k_norm_weight is not None else cos_cache,
        k_cache,
        v_cache,
        slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        stride_v_tok,
        stride_v_head,
        *cache_strides,
        eps,
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        HB=hb,
        HAS_NORM=q_norm_weight is not None,
        STORE_KV=kv_store is not None,
        num_warps=4,
    )
