"""Triton split-K paged decode attention with GQA: one query token per sequence.

Cache layout as in triton_kernels.py. Decode splits each sequence's context
into ``num_splits`` chunks so small batches still fill the GPU; one program
handles all query heads of a KV head (the GQA group), so each K/V tile is read
once per group, and a second kernel merges the chunks' partial softmaxes.
Chunks are whole tiles cut from each sequence's own length, so a context
shorter than the split count was planned for leaves the last splits empty:
they return at once and the merge skips them. With one split there is no
merge launch. A sliding-window layer's context is its window, the last
``window`` keys: the splits cut that, and nothing before it is read (its
blocks may be freed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.attention.kv_quant import is_fp8, scales_or
from engine.layers.attention.triton_jit import step_jit
from engine.layers.attention.triton_scores import load_kv, scaled_scores

# The launch configuration (tile, warps, pipeline stages): the best of
# benchmarks/tune_kernels.py on one GPU (docs/performance.md, "Kernel tuning",
# names it and the record).
DECODE_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4}


@triton.jit
def _context_start(seq_len, window, SLIDING: tl.constexpr):
    """The first key the query (at seq_len - 1) sees."""
    if SLIDING:
        return tl.maximum(seq_len - window, 0)
    return 0


@triton.jit
def _split_bounds(num_keys, num_splits, BLOCK_N: tl.constexpr):
    """(keys per split, splits with keys) of one sequence: its ``num_keys`` visible
    keys cut into num_splits chunks of whole BLOCK_N tiles; a short context fills
    only the first few (the split kernel and the reduce must agree on this)."""
    chunk = tl.cdiv(tl.cdiv(num_keys, num_splits), BLOCK_N) * BLOCK_N
    used = tl.cdiv(num_keys, tl.maximum(chunk, 1))
    return chunk, used


# The split count is a runtime argument, not a constexpr: eager steps (a mixed
# batch) pick it from the batch's size and longest context, and a constexpr made
# every new count a Triton compile of a second or so inside a serving step (a
# node's first minutes had TTFT spikes of a second from it). ONE_SPLIT keeps the
# one-split path (direct store, no reduce) a separate compiled variant.
@step_jit(ints=("stride_bt", "num_splits"), pointers=("block_tables_ptr", "seq_lens_ptr"))
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32 (log-sum-exp, base 2)
    out_ptr,  # the output itself when ONE_SPLIT (no reduce)
    scale,
    softcap,
    window,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    num_splits,
    ONE_SPLIT: tl.constexpr,  # num_splits == 1
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a tensor-core-friendly size
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds FP8 entries x the layer's scales
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    seq_len = tl.load(seq_lens_ptr + seq)
    first = _context_start(seq_len, window, SLIDING)
    chunk, used = _split_bounds(seq_len - first, num_splits, BLOCK_N)
    # A compile-time test around the runtime one (no `and` of constexpr and tensor).
    if not ONE_SPLIT:  # noqa: SIM102
        if split >= used:
            # No keys here (a context shorter than the graph's split count was
            # sized for): nothing to compute or store; the reduce reads only
            # the used splits.
            return
    start = first + split * chunk
    end = tl.minimum(seq_len, start + chunk)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.44269504
    bt = block_tables_ptr + seq * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        slots = blocks.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot
        kv_off = slots[:, None] + kv_head * stride_cache_head + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_kv(k_cache_ptr, kv_off, kv_mask, q, kv_scales_ptr, KV_FP8)
        qk = scaled_scores(q, k, qk_scale, softcap, HAS_SOFTCAP)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(v_cache_ptr, kv_off, kv_mask, q, kv_scales_ptr + 1, KV_FP8)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if ONE_SPLIT:
        # One split: this is the result (what the reduce would compute, bit for
        # bit), stored directly, so no reduce launch.
        tl.store(
            out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # A split with nothing visible (l = 0) reports lse = -inf: weight 0.
        lse = tl.where(
            l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i))
        )
        base = (seq * num_heads + heads) * num_splits + split
        tl.store(
            part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=g_mask[:, None] & d_mask[None, :],
        )
        tl.store(part_lse_ptr + base, lse, mask=g_mask)


@step_jit(ints=("num_splits",), pointers=("seq_lens_ptr",))
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_o_tok,
    stride_o_head,
    num_splits,
    window,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = _context_start(seq_len, window, SLIDING)
    _, used = _split_bounds(seq_len - first, num_splits, BLOCK_N)
    s_mask = offs_s < used  # the splits that ran (the others stored nothing)
    d_mask = offs_d < HEAD_DIM
    base = (seq * num_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + seq * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# The fewest keys a split gets, one default tile: at batch 1 a 1024-token context
# spreads over 16 one-tile splits (256 gave 4 splits of 4 tiles on 32 SMs).
MIN_SPLIT_KEYS = 64


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits that the grid covers the GPU about twice, never below
    MIN_SPLIT_KEYS keys a split (a CUDA graph plans for max_model_len; a shorter
    context leaves the later splits empty, and they return at once)."""
    programs = max(1, num_seqs * num_kv_heads)
    want = triton.cdiv(2 * num_sms, programs)
    return int(max(1, min(want, triton.cdiv(max_seq_len, MIN_SPLIT_KEYS), 64)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: dict[str, int] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """One query per sequence (q: [num_seqs, num_heads, head_dim]); FP8 caches need ``kv_scales``."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cfg = {**DECODE_CONFIG, **(config or {})}
    part_out, part_lse = _split_workspace(q, out, num_splits, workspace)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        scales_or(kv_scales, k_cache),
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        out,
        scale,
        logits_soft_cap or 1.0,
        sliding_window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_splits,
        ONE_SPLIT=num_splits == 1,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=cfg["BLOCK_N"],
        SLIDING=sliding_window is not None,
        HAS_SOFTCAP=logits_soft_cap is not None,
        KV_FP8=is_fp8(k_cache.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _reduce_splits(
            part_out, part_lse, seq_lens, out, num_splits, sliding_window, cfg["BLOCK_N"]
        )


def _split_workspace(q, out, num_splits, workspace):
    """(partial outputs, their log-sum-exps): the caller's, new ones, or
    ``out`` twice where one split writes the output itself."""
    if num_splits == 1:
        return out, out  # unused
    if workspace is not None:
        return workspace
    num_seqs, num_heads, head_dim = q.shape
    part_out = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    return part_out, part_lse


def _reduce_splits(part_out, part_lse, seq_lens, out, num_splits, sliding_window, block_n):
    """Merge the splits' partial outputs into ``out``."""
    num_seqs, num_heads, head_dim = out.shape
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        seq_lens,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        sliding_window or 0,
        BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        SLIDING=sliding_window is not None,
        num_warps=4,
    )
