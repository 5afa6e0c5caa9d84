"""Triton kernels for paged attention: KV store and varlen prefill over a paged
prefix (split-K decode with GQA is triton_decode.py).

Cache layout (see backend.py): ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of sequence
``s`` lives at slot ``block_tables[s, p // block_size] * block_size + p % block_size``.

Prefill reads every key, the new ones included, from the cache (the store
kernel runs first), so one code path serves fresh prompts, chunks and prompts
with a prefix-cache hit. An FP8 cache (``KV_FP8``) is stored divided by the
layer's scales and read tile by tile, each tile converted and scaled in
registers (triton_scores.load_kv). ``_prefill_kernel`` gives each program one query tile
and head and walks the whole context (the longest tiles started first, the
causal mask only on the diagonal tiles); a short query over a long context (a
prompt mostly served from the prefix cache) leaves most SMs idle that way, and
``prefill_attention(num_splits >= 1)`` hands it to triton_prefill_split.py,
which packs a KV head's query heads into one tile, cuts the context into chunks
and merges them (its ``prefill_num_splits`` picks the count, 0 for this kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.attention.kv_quant import FP8_MAX as _FP8_MAX
from engine.layers.attention.kv_quant import is_fp8, scales_or
from engine.layers.attention.triton_jit import step_jit
from engine.layers.attention.triton_prefill_split import prefill_split_attention
from engine.layers.attention.triton_scores import load_kv, scaled_scores

FP8_MAX: tl.constexpr = tl.constexpr(_FP8_MAX)

# Launch configurations (tile sizes, warps, pipeline stages); the defaults are the
# best of benchmarks/tune_kernels.py on one GPU (docs/performance.md, "Kernel
# tuning", names it and the record).
PREFILL_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
PREFILL_CONFIG_SHORT = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@step_jit(pointers=("slot_ptr",))
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    kv_scales_ptr,  # [k_scale, v_scale] float32 (read when KV_FP8)
    stride_k_tok,
    stride_v_tok,
    stride_cache_slot,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache stores value / scale in FP8, saturated
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:  # padding rows of a CUDA graph batch
        return
    for start in range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + tok * stride_k_tok + offs, mask=mask)
        v = tl.load(v_ptr + tok * stride_v_tok + offs, mask=mask)
        if KV_FP8:
            k = _to_fp8(k, tl.load(kv_scales_ptr), k_cache_ptr)
            v = _to_fp8(v, tl.load(kv_scales_ptr + 1), v_cache_ptr)
        tl.store(k_cache_ptr + slot * stride_cache_slot + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * stride_cache_slot + offs, v, mask=mask)


@triton.jit
def _to_fp8(x, scale, cache_ptr):
    # e4m3fn has no infinity: saturate, or a value past its range becomes NaN.
    y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    return y.to(cache_ptr.dtype.element_ty)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Each new token's K and V at its slot; an FP8 cache gets them divided by
    ``kv_scales`` ([k_scale, v_scale])."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    k2, v2 = k.reshape(num_tokens, row), v.reshape(num_tokens, row)
    _store_kv_kernel[(num_tokens,)](
        k2,
        v2,
        k_cache,
        v_cache,
        slot_mapping,
        scales_or(kv_scales, k_cache),
        k2.stride(0),
        v2.stride(0),
        k_cache.stride(1),
        ROW=row,
        BLOCK=min(triton.next_power_of_2(row), 1024),
        KV_FP8=is_fp8(k_cache.dtype),
    )


@triton.jit
def _attend_key_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    start_n,
    lo,
    end,
    bt,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    kv_head,
    offs_d,
    d_mask,
    qk_scale,
    softcap,
    window,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One key tile of ``_prefill_kernel``'s online softmax: (acc, m_i, l_i) after
    keys ``start_n`` .. ``start_n + BLOCK_N``. ``MASKED``: the tile crosses the
    causal diagonal or the context's end (keys at ``end`` and past it, and those
    after a row's own position, are hidden), or a sliding window's start (keys
    before ``lo`` are not even loaded: their blocks may be freed, and keys at or
    before a row's position - ``window`` are hidden); without it every key is
    visible to every row, and no select stands between the scaled scores and the
    exponent."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = (offs_n < end) & (offs_n >= lo)
        blocks = tl.load(bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        blocks = tl.load(bt + offs_n // BLOCK_SIZE)
        kv_mask = d_mask[None, :]
    slots = blocks.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot
    kv_off = slots[:, None] + kv_head * stride_cache_head + offs_d[None, :]
    k = load_kv(k_cache_ptr, kv_off, kv_mask, q, kv_scales_ptr, KV_FP8)
    qk = scaled_scores(q, k, qk_scale, softcap, HAS_SOFTCAP)
    if MASKED:
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING:
            causal &= offs_n[None, :] > q_pos[:, None] - window
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Rows with nothing visible yet keep m = -inf; guard the exponent.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = m_new
    p = tl.math.exp2(qk - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv(v_cache_ptr, kv_off, kv_mask, q, kv_scales_ptr + 1, KV_FP8)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@step_jit(ints=("stride_bt",), pointers=("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"))
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
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
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,  # keys before each row's window are hidden
    HAS_SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds FP8 entries x the layer's scales
):
    # Grid (heads, sequences, query tiles), the tiles last and counted down: the
    # GPU starts programs in grid order, so the causal triangle's long tiles (the
    # last rows walk the whole context) all start first and its short ones fill
    # the last wave, instead of one sequence's long tiles ending the launch.
    head = tl.program_id(0)
    seq = tl.program_id(1)
    m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    # Bottom-right causal: new token i sits at position prefix_len + i.
    q_pos = prefix_len + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.44269504  # softmax in base 2
    end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
    bt = block_tables_ptr + seq * stride_bt
    # Every row of the tile sees the keys up to prefix_len + m_block * BLOCK_M:
    # the whole key tiles below that need neither the causal nor the length mask,
    # and a row's maximum is finite from the first one on (key 0 is always
    # visible). Only the tiles along the diagonal take the masked loop below.
    # Per row the same tiles in the same order as one masked loop, but not quite
    # the same bits on a GPU: without the select, the compiler fuses the scale
    # into the exponent's subtraction (one rounding fewer), so outputs move by
    # up to 2 bf16 units in the last place
    # (docs/lab/2026-11-27-prefill-attention-prefix-sharing.md; the CPU
    # interpreter gives the same bits), and a row's bits now depend on which
    # query tile it falls in (the tile's first row sets the split).
    if SLIDING:
        # The tile's first row sees nothing before lo: start at its tile, every
        # tile masked (the window's lower edge crosses them too).
        lo = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
        for start_n in range(lo // BLOCK_N * BLOCK_N, end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, q, q_pos, start_n, lo, end, bt, k_cache_ptr, v_cache_ptr,
                kv_scales_ptr, kv_head, offs_d, d_mask, qk_scale, softcap, window, stride_cache_block,
                stride_cache_slot, stride_cache_head, BLOCK_SIZE, BLOCK_N, MASKED=True,
                SLIDING=True, HAS_SOFTCAP=HAS_SOFTCAP, KV_FP8=KV_FP8,
            )  # fmt: skip
    else:
        full_end = (prefix_len + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, q, q_pos, start_n, 0, end, bt, k_cache_ptr, v_cache_ptr,
                kv_scales_ptr, kv_head, offs_d, d_mask, qk_scale, softcap, window, stride_cache_block,
                stride_cache_slot, stride_cache_head, BLOCK_SIZE, BLOCK_N, MASKED=False,
                SLIDING=False, HAS_SOFTCAP=HAS_SOFTCAP, KV_FP8=KV_FP8,
            )  # fmt: skip
        for start_n in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _attend_key_tile(
                acc, m_i, l_i, q, q_pos, start_n, 0, end, bt, k_cache_ptr, v_cache_ptr,
                kv_scales_ptr, kv_head, offs_d, d_mask, qk_scale, softcap, window, stride_cache_block,
                stride_cache_slot, stride_cache_head, BLOCK_SIZE, BLOCK_N, MASKED=True,
                SLIDING=False, HAS_SOFTCAP=HAS_SOFTCAP, KV_FP8=KV_FP8,
            )  # fmt: skip
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr
        + (q_start + offs_m)[:, None] * stride_o_tok
        + head * stride_o_head
        + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    config: dict[str, int] | None = None,
    num_splits: int = 0,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Varlen causal prefill over the paged cache (an FP8 one read with
    ``kv_scales``), written into ``out``. With
    ``num_splits`` >= 1 the split-context kernels run instead (``config`` and
    ``workspace`` are then theirs: triton_prefill_split.py); they take neither
    a window nor a soft cap."""
    if num_splits >= 1:
        if sliding_window is not None or logits_soft_cap is not None:
            raise ValueError("the split prefill takes no sliding window or soft cap")
        prefill_split_attention(
            q,
            k_cache,
            v_cache,
            out,
            block_tables,
            query_start_loc,
            seq_lens,
            max_query_len,
            scale,
            num_splits,
            workspace,
            config,
            kv_scales,
        )
        return
    _prefill_one_pass(
        q,
        k_cache,
        v_cache,
        out,
        (block_tables, query_start_loc, seq_lens),
        max_query_len,
        scale,
        config,
        sliding_window,
        logits_soft_cap,
        kv_scales,
    )


def _prefill_one_pass(
    q,
    k_cache,
    v_cache,
    out,
    step,
    max_query_len,
    scale,
    config,
    sliding_window,
    logits_soft_cap,
    kv_scales,
):
    """The one-kernel prefill: a program per (head, sequence, query tile)."""
    block_tables, query_start_loc, seq_lens = step
    _, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cfg = dict(PREFILL_CONFIG if max_query_len > 32 else PREFILL_CONFIG_SHORT)
    cfg.update(config or {})
    block_m = cfg["BLOCK_M"]
    grid = (num_heads, num_seqs, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        scales_or(kv_scales, k_cache),
        out,
        block_tables,
        query_start_loc,
        seq_lens,
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
        GROUP=num_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        SLIDING=sliding_window is not None,
        HAS_SOFTCAP=logits_soft_cap is not None,
        KV_FP8=is_fp8(k_cache.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
