"""Prefill of short queries over a long paged context, split over the context.

The case: a request whose prompt is mostly a cached prefix (the shared-prefix
serving workload: 128 new tokens over 2,048 cached). triton_kernels.py's
``_prefill_kernel`` gives one program to each 64 query rows and query head,
each walking the whole context: for 128 new tokens that is fewer programs than
a large GPU has SMs, every one a long serial loop, so the GPU sits mostly idle
(docs/lab/2026-11-25-shared-prefix-steps-slower.md).

Here each program takes one tile of query rows and one *chunk* of the
sequence's keys, and a second kernel merges the chunks' partial softmaxes by
their log-sum-exp, as triton_decode.py does for decode. Two more changes make
the tiles worth having:

- GQA packing: a program's rows are ``TOKS`` query tokens times the ``GROUP``
  query heads of one KV head (row r is token r // GROUP, head r % GROUP), so
  each K/V tile is loaded once per group instead of once per query head, and
  16 tokens of a 4-head group still make a 64-row tile for the tensor cores.
- Chunks are whole ``BLOCK_N`` tiles cut from each sequence's own length (as
  decode's ``_split_bounds``); the causal limit of a query tile cuts the last
  chunks short or empties them (those programs return at once).

``prefill_num_splits`` is the rule that picks the split count; 0 means the
split does not pay (a long query, no cached context before the query, or too
little context for two chunks) and
the caller runs ``_prefill_kernel`` as before. One split (callers may ask for
it) stores the rows directly, without workspace or merge: the packed tile
alone, which measured no faster than ``_prefill_kernel``
(docs/lab/2026-11-25-prefill-split-over-context.md), so the rule never picks it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.attention.kv_quant import is_fp8, scales_or
from engine.layers.attention.triton_jit import step_jit
from engine.layers.attention.triton_scores import load_kv

# Rows (query tokens x GROUP heads) and keys per tile, warps, stages: the best
# geometric mean of `benchmarks/tune_kernels.py --part split-prefill --sweep`
# over short queries of one to several prompts, chosen for the many-prompt
# cases as well as the one-prompt ones (the sweep:
# docs/lab/2026-11-25-prefill-split-over-context.md).
PREFILL_SPLIT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
# The fewest keys a split gets: each split costs its partial's store and the
# merge's read (fp32, num_heads x head_dim per query token), so a chunk must
# carry enough keys to amortise them.
MIN_PREFILL_SPLIT_KEYS = 256
MAX_PREFILL_SPLITS = 16
# Longer queries were not measured (at 512 new tokens the gain was already
# small: docs/lab/2026-11-25-prefill-split-over-context.md): their
# grid covers the GPU on its own and the causal triangle empties the early
# tiles' last chunks.
PREFILL_SPLIT_MAX_QUERY = 512


def tokens_per_tile(group: int, block_m: int) -> int:
    """Query tokens in one program's rows (at least one, for groups wider than the tile)."""
    return max(1, block_m // group)


def prefill_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int,
    block_m: int | None = None,
) -> int:
    """Chunks per sequence for the split prefill; 0: run the unsplit kernel.

    0 for a query over PREFILL_SPLIT_MAX_QUERY tokens or without
    MIN_PREFILL_SPLIT_KEYS keys of context before it (a fresh prompt: this
    kernel was not measured there). Else as many splits as keep the programs
    (query tiles x KV heads x sequences, sized by the longest query, times the
    splits) within two per SM, but at least two: more splits for one short
    prompt, two where the grid alone covers the GPU (two splits were still
    faster than one there, and one is no faster than the unsplit kernel);
    the rule matched the best of `tune_kernels.py --part split-prefill
    --sweep-splits` to within a few percent
    (docs/lab/2026-11-25-prefill-split-over-context.md). Never fewer than
    MIN_PREFILL_SPLIT_KEYS keys a chunk, at most MAX_PREFILL_SPLITS; 0 where
    that leaves fewer than two.
    """
    if not 0 < max_query_len <= PREFILL_SPLIT_MAX_QUERY:
        return 0
    if max_seq_len - max_query_len < MIN_PREFILL_SPLIT_KEYS:
        return 0
    toks = tokens_per_tile(group, block_m or PREFILL_SPLIT_CONFIG["BLOCK_M"])
    tiles = triton.cdiv(max_query_len, toks) * num_kv_heads * max(1, num_seqs)
    want = max(2, (2 * num_sms) // tiles)
    splits = min(want, max_seq_len // MIN_PREFILL_SPLIT_KEYS, MAX_PREFILL_SPLITS)
    return int(splits) if splits >= 2 else 0


def make_workspace(
    num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials of one call: outputs [splits, tokens, heads, head_dim] and their
    log-sum-exps [splits, tokens, heads], fp32. The backend makes one per step and
    every layer reuses it (the layers run one after another on one stream)."""
    part_out = torch.empty(
        num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=device
    )
    part_lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=device)
    return part_out, part_lse


@triton.jit
def _tile_rows(
    m_block, kv_head, q_len, GROUP: tl.constexpr, TOKS: tl.constexpr, BLOCK_M: tl.constexpr
):
    """(token within the query, query head, row valid) of each row of a tile."""
    offs_r = tl.arange(0, BLOCK_M)
    tok = m_block * TOKS + offs_r // GROUP
    head = kv_head * GROUP + offs_r % GROUP
    mask = (offs_r < TOKS * GROUP) & (tok < q_len)
    return tok, head, mask


@triton.jit
def _chunk_keys(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split of one sequence, whole BLOCK_N tiles (split and merge must agree)."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


# The split count is a runtime argument (not a constexpr), so a new count in a
# serving step is no new compile (see triton_decode.py).
@step_jit(
    ints=("stride_bt", "num_tokens", "num_splits"),
    pointers=("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"),
)
def _prefill_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_scales_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    part_out_ptr,  # [num_splits, num_tokens, num_heads, HEAD_DIM] fp32
    part_lse_ptr,  # [num_splits, num_tokens, num_heads] fp32 (log-sum-exp, base 2)
    out_ptr,  # the output itself when ONE_SPLIT (no merge)
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    num_tokens,
    num_splits,
    ONE_SPLIT: tl.constexpr,  # num_splits == 1
    GROUP: tl.constexpr,
    TOKS: tl.constexpr,  # query tokens per tile: BLOCK_M // GROUP
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FP8: tl.constexpr,  # the cache holds FP8 entries x the layer's scales
):
    pid = tl.program_id(0)
    m_block = pid // num_splits
    split = pid % num_splits
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    chunk = _chunk_keys(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    # Bottom-right causal: the tile's last token sees keys up to prefix_len + its index.
    end = tl.minimum(tl.minimum(seq_len, prefix_len + (m_block + 1) * TOKS), start + chunk)
    # A tile past this sequence's query, or a chunk wholly after the tile's causal
    # limit: nothing to store, the merge does not read it.
    if (m_block * TOKS >= q_len) | (start >= end):
        return

    tok, head, r_mask = _tile_rows(m_block, kv_head, q_len, GROUP, TOKS, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr
        + (q_start + tok)[:, None] * stride_q_tok
        + head[:, None] * stride_q_head
        + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix_len + tok
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.44269504  # softmax in base 2
    bt = block_tables_ptr + seq * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        slots = blocks.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot
        kv_off = slots[:, None] + kv_head * stride_cache_head + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = load_kv(k_cache_ptr, kv_off, kv_mask, q, kv_scales_ptr, KV_FP8)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Rows that see nothing of this chunk (yet) keep m = -inf; guard the exponent.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv(v_cache_ptr, kv_off, kv_mask, q, kv_scales_ptr + 1, KV_FP8)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if ONE_SPLIT:
        # The whole context: this is the result (what the merge would compute
        # from one split, bit for bit), stored directly, so no merge launch.
        tl.store(
            out_ptr
            + (q_start + tok)[:, None] * stride_o_tok
            + head[:, None] * stride_o_head
            + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=r_mask[:, None] & d_mask[None, :],
        )
    else:
        # A row with nothing visible in this chunk reports lse = -inf: weight 0.
        lse = tl.where(
            l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i))
        )
        row = (split * num_tokens + q_start + tok).to(tl.int64) * num_heads + head
        tl.store(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=r_mask[:, None] & d_mask[None, :],
        )
        tl.store(part_lse_ptr + row, lse, mask=r_mask)


@step_jit(ints=("num_tokens", "num_splits"), pointers=("query_start_loc_ptr", "seq_lens_ptr"))
def _prefill_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    stride_o_tok,
    stride_o_head,
    num_tokens,
    num_splits,
    GROUP: tl.constexpr,
    TOKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * TOKS >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    chunk = _chunk_keys(seq_len, num_splits, BLOCK_N)
    used = tl.cdiv(tl.minimum(seq_len, prefix_len + (m_block + 1) * TOKS), chunk)
    tok, head, r_mask = _tile_rows(m_block, kv_head, q_len, GROUP, TOKS, BLOCK_M)
    q_pos = prefix_len + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(0, used):
        # Split s holds keys this row sees iff its first key is at or before the
        # row's position; then its program ran and stored this row (the others
        # may not have run: their memory is not read).
        valid = r_mask & (s * chunk <= q_pos)
        row = (s * num_tokens + q_start + tok).to(tl.int64) * num_heads + head
        lse = tl.load(part_lse_ptr + row, mask=valid, other=float("-inf"))
        part = tl.load(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + part * w[:, None]
        l_sum = l_sum * alpha + w
        m = m_new
    out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    tl.store(
        out_ptr
        + (q_start + tok)[:, None] * stride_o_tok
        + head[:, None] * stride_o_head
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


def prefill_split_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    num_splits: int,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: dict[str, int] | None = None,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Varlen prefill as ``_prefill_kernel`` computes it, each sequence's keys cut
    into ``num_splits`` chunks (1: the whole context, stored directly); writes
    into ``out``. The workspace (make_workspace; only for 2 splits or more) must
    have num_splits splits and at least q's rows."""
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cfg = dict(PREFILL_SPLIT_CONFIG)
    cfg.update(config or {})
    consts = _tile_constants(q.shape[1] // num_kv_heads, q.shape[2], cfg)
    one = num_splits == 1
    part_out, part_lse, rows = _split_buffers(q, out, num_splits, workspace)
    m_blocks = triton.cdiv(max_query_len, consts["TOKS"])
    _prefill_split_kernel[(m_blocks * num_splits, num_kv_heads, num_seqs)](
        q,
        k_cache,
        v_cache,
        scales_or(kv_scales, k_cache),
        block_tables,
        query_start_loc,
        seq_lens,
        part_out,
        part_lse,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        rows,
        num_splits,
        ONE_SPLIT=one,
        BLOCK_SIZE=block_size,
        KV_FP8=is_fp8(k_cache.dtype),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **consts,
    )
    if not one:
        grid = (m_blocks, num_kv_heads, num_seqs)
        _merge_splits(grid, part_out, part_lse, out, query_start_loc, seq_lens, rows, consts)


def _merge_splits(grid, part_out, part_lse, out, query_start_loc, seq_lens, rows, consts):
    """The splits' partial outputs merged into ``out``."""
    _prefill_merge_kernel[grid](
        part_out,
        part_lse,
        out,
        query_start_loc,
        seq_lens,
        out.stride(0),
        out.stride(1),
        rows,
        part_lse.shape[0],
        num_warps=4,
        **consts,
    )


def _tile_constants(group: int, head_dim: int, cfg: dict[str, int]) -> dict[str, int]:
    """The kernels' compile-time tile shape for a query-head group."""
    # A group wider than the tile still needs one token's rows in it.
    block_m = max(cfg["BLOCK_M"], triton.next_power_of_2(group))
    return dict(
        GROUP=group,
        TOKS=tokens_per_tile(group, block_m),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
    )


def _split_buffers(q, out, num_splits, workspace):
    """(partial outputs, their log-sum-exps, rows per split): the workspace's
    (a new one where none was given), or ``out`` where one split writes it."""
    num_tokens, num_heads, head_dim = q.shape
    if num_splits == 1:
        return out, out, num_tokens  # the buffers unused
    if workspace is None:
        workspace = make_workspace(num_tokens, num_heads, head_dim, num_splits, q.device)
    part_out, part_lse = workspace
    if part_lse.shape[0] != num_splits or part_lse.shape[1] < num_tokens:
        raise ValueError(
            f"a workspace of {part_lse.shape[0]} splits x {part_lse.shape[1]} rows for "
            f"{num_splits} splits of {num_tokens} tokens"
        )
    return part_out, part_lse, part_lse.shape[1]
