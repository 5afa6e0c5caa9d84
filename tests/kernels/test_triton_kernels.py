"""Our Triton kernels against the torch reference over random shapes.

Without a GPU they run under Triton's interpreter at small sizes (CI); on a GPU
host the same tests run natively at larger sizes.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.layers.attention.torch_backend import TorchAttention, gather_kv

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
ATOL = 2e-2 if ON_GPU else 1e-4
SCALE = 2 if ON_GPU else 1  # bigger shapes on a GPU

tk = pytest.importorskip("engine.layers.attention.triton_kernels", reason="triton is not installed")
td = pytest.importorskip("engine.layers.attention.triton_decode", reason="triton is not installed")
ts = pytest.importorskip(
    "engine.layers.attention.triton_prefill_split", reason="triton is not installed"
)


def random_layout(rng, q_lens, prefix_lens, block_size, num_blocks):
    """Block tables drawn at random from the pool (no block shared)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for q, p in zip(q_lens, prefix_lens, strict=True):
        n = -(-(q + p) // block_size)
        tables.append([free.pop() for _ in range(n)])
    width = max(len(t) for t in tables)
    bt = torch.tensor(
        [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
    )
    return bt


def reference(q, k_cache, v_cache, bt, q_lens, seq_lens, num_heads, num_kv_heads, head_dim):
    ref = TorchAttention(num_heads, num_kv_heads, head_dim, head_dim**-0.5, k_cache.shape[1])
    out, start = [], 0
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        keys = gather_kv(k_cache, bt[i], sl).float()
        values = gather_kv(v_cache, bt[i], sl).float()
        out.append(ref._attend(q[start : start + ql].float(), keys, values, ql, sl))
        start += ql
    return torch.cat(out)


CASES = [
    # (q_lens, prefix_lens, heads, kv_heads, head_dim, block_size)
    ([5, 17, 1], [0, 23, 40], 4, 2, 64, 16),
    ([33], [0], 8, 1, 128, 8),
    ([1, 9, 64], [100, 0, 7], 4, 4, 64, 32),
    ([12, 3], [50, 0], 6, 2, 128, 256),
    ([70], [130], 8, 8, 64, 64),
    # Three query tiles beside one-tile sequences (the tiles counted down from
    # the grid's longest: the others' high tiles return at once), prefixes that
    # are not whole key tiles (the unmasked loop stops short of the diagonal).
    ([130, 3, 64], [0, 45, 96], 4, 2, 64, 16),
]


@pytest.mark.parametrize("q_lens, prefix_lens, heads, kv_heads, head_dim, block_size", CASES)
def test_prefill_over_paged_prefix_matches_torch(
    q_lens, prefix_lens, heads, kv_heads, head_dim, block_size
):
    rng = random.Random(0)
    torch.manual_seed(0)
    q_lens = [q * SCALE for q in q_lens]
    prefix_lens = [p * SCALE for p in prefix_lens]
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    bt = random_layout(rng, q_lens, prefix_lens, block_size, num_blocks)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    out = torch.empty_like(q)
    tk.prefill_attention(
        q,
        k_cache,
        v_cache,
        out,
        bt,
        qsl,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max(q_lens),
        head_dim**-0.5,
    )
    ref = reference(q, k_cache, v_cache, bt, q_lens, seq_lens, heads, kv_heads, head_dim)
    assert torch.allclose(out.float(), ref, atol=ATOL, rtol=ATOL), (out.float() - ref).abs().max()


def prefill_case(rng, q_lens, prefix_lens, heads, kv_heads, head_dim, block_size):
    """Random cache, block tables, queries and lengths of one varlen prefill batch."""
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    bt = random_layout(rng, q_lens, prefix_lens, block_size, num_blocks)
    q = torch.randn(sum(q_lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    qsl = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, bt, qsl, lens, seq_lens


SPLIT_CASES = [
    # (q_lens, prefix_lens, heads, kv_heads, head_dim, block_size, num_splits, config)
    # Each case as small as its point allows: CI runs them in Triton's interpreter.
    ([16], [200], 8, 2, 64, 16, 4, None),  # GQA: one short query over a long prefix
    # No cached prefix, a chunk-sized one and a long one; lengths not multiples of the block.
    ([5, 17, 1], [0, 23, 300], 4, 2, 64, 16, 3, None),
    ([33], [90], 8, 1, 128, 8, 2, None),  # a group of 8: 8 tokens a 64-row tile
    ([12, 3], [150, 0], 6, 2, 128, 256, 5, None),  # a group of 3: not a power of two
    ([20], [130], 4, 4, 64, 64, 16, None),  # MHA; more splits than the context fills
    ([9, 20], [77, 41], 8, 2, 64, 16, 8, {"BLOCK_M": 16, "BLOCK_N": 32}),  # 4 tokens a tile
    ([4], [60], 32, 1, 64, 16, 3, {"BLOCK_M": 16}),  # group 32 wider than the tile
    # One split: the whole context, stored directly (no workspace, no merge).
    ([5, 17, 1], [0, 23, 300], 4, 2, 64, 16, 1, None),
    ([9, 20], [77, 41], 8, 2, 64, 16, 1, None),
]


@pytest.mark.parametrize(
    "q_lens, prefix_lens, heads, kv_heads, head_dim, block_size, num_splits, config", SPLIT_CASES
)
def test_split_prefill_matches_torch_and_the_unsplit_kernel(
    q_lens, prefix_lens, heads, kv_heads, head_dim, block_size, num_splits, config
):
    rng = random.Random(3)
    torch.manual_seed(3)
    q_lens = [q * SCALE for q in q_lens]
    prefix_lens = [p * SCALE for p in prefix_lens]
    q, k_cache, v_cache, bt, qsl, lens, seq_lens = prefill_case(
        rng, q_lens, prefix_lens, heads, kv_heads, head_dim, block_size
    )
    args = (k_cache, v_cache)
    split, unsplit = torch.full_like(q, float("nan")), torch.empty_like(q)
    meta = (bt, qsl, lens, max(q_lens), head_dim**-0.5)
    tk.prefill_attention(q, *args, split, *meta, config=config, num_splits=num_splits)
    tk.prefill_attention(q, *args, unsplit, *meta)
    ref = reference(q, k_cache, v_cache, bt, q_lens, seq_lens, heads, kv_heads, head_dim)
    assert torch.allclose(split.float(), ref, atol=ATOL, rtol=ATOL), (
        (split.float() - ref).abs().max()
    )
    assert torch.allclose(split.float(), unsplit.float(), atol=ATOL, rtol=ATOL)


def test_split_prefill_writes_into_a_strided_out_and_reuses_its_workspace():
    """The backend's case: out is a slice of a larger buffer (rows after the decode
    rows), and one workspace serves every layer of the step."""
    rng = random.Random(4)
    q, k_cache, v_cache, bt, qsl, lens, seq_lens = prefill_case(
        rng, [7, 11], [260, 90], 8, 2, 64, 16
    )
    big = torch.zeros(3 + q.shape[0], 8, 64, device=DEVICE, dtype=DTYPE)
    ws = ts.make_workspace(q.shape[0], 8, 64, 2, DEVICE)
    ref = reference(q, k_cache, v_cache, bt, [7, 11], seq_lens, 8, 2, 64)
    for _ in range(2):
        out = big[3:]
        tk.prefill_attention(
            q, k_cache, v_cache, out, bt, qsl, lens, 11, 0.125, num_splits=2, workspace=ws
        )
        assert torch.allclose(out.float(), ref, atol=ATOL, rtol=ATOL)
    assert torch.equal(big[:3], torch.zeros_like(big[:3]))


def test_prefill_split_rule():
    # Llama-3.1-8B heads (8 KV heads, groups of 4) on an H200's 132 SMs, 2,048 cached:
    # 64 tiles of 16 tokens x 4 heads for 128 new tokens -> 4 splits, 256 programs.
    one = [ts.prefill_num_splits(1, 8, 4, n, 2048 + n, 132) for n in (128, 64, 32)]
    assert one == [4, 8, 8]
    # A grid that fills the GPU on its own: still two splits (measured 1.1-1.4x).
    assert ts.prefill_num_splits(4, 8, 4, 512, 2560, 132) == 2
    assert ts.prefill_num_splits(8, 8, 4, 128, 2176, 132) == 2
    # A fresh prompt, a context too short for two chunks, a long query: unsplit.
    assert ts.prefill_num_splits(1, 8, 4, 128, 128, 132) == 0
    assert ts.prefill_num_splits(1, 8, 4, 128, 300, 132) == 0
    assert ts.prefill_num_splits(1, 8, 4, 100, 500, 132) == 0
    assert ts.prefill_num_splits(1, 8, 4, 1024, 3072, 132) == 0
    assert ts.prefill_num_splits(1, 8, 4, 16, 1 << 20, 132) == ts.MAX_PREFILL_SPLITS


DECODE_CASES = [
    # (seq_lens, heads, kv_heads, head_dim, block_size, num_splits)
    ([1, 17, 40], 4, 2, 64, 16, 1),
    ([1, 17, 40], 4, 2, 64, 16, 3),
    ([200, 5], 8, 1, 128, 8, 4),
    ([64, 65, 300], 16, 2, 128, 256, 2),
    ([31], 4, 4, 64, 32, 8),
    # Splits planned for a longer context than the batch has (a CUDA graph sized
    # for max_model_len): the later splits are empty and the merge skips them.
    ([1, 5, 70, 300], 4, 2, 64, 16, 16),
    ([0, 40, 129], 8, 2, 64, 16, 5),  # with a padding row (seq_len 0)
]


@pytest.mark.parametrize(
    "seq_lens, heads, kv_heads, head_dim, block_size, num_splits", DECODE_CASES
)
def test_split_k_decode_matches_torch(seq_lens, heads, kv_heads, head_dim, block_size, num_splits):
    rng = random.Random(1)
    torch.manual_seed(1)
    seq_lens = [s * SCALE for s in seq_lens]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    bt = random_layout(rng, [1] * len(seq_lens), [s - 1 for s in seq_lens], block_size, num_blocks)
    q = torch.randn(len(seq_lens), heads, head_dim, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(q)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    td.decode_attention(q, k_cache, v_cache, out, bt, lens, head_dim**-0.5, num_splits)
    ref = reference(
        q, k_cache, v_cache, bt, [1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim
    )
    assert torch.allclose(out.float(), ref, atol=ATOL, rtol=ATOL), (out.float() - ref).abs().max()


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_padding_rows_read_nothing(num_splits):
    """CUDA-graph padding rows have seq_len 0: their output is zero, no NaN."""
    k_cache = torch.full((4, 16, 2, 64), float("nan"), device=DEVICE, dtype=DTYPE)
    v_cache = torch.full_like(k_cache, float("nan"))
    q = torch.randn(2, 4, 64, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(q)
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    td.decode_attention(
        q,
        k_cache,
        v_cache,
        out,
        bt,
        torch.zeros(2, dtype=torch.int32, device=DEVICE),
        0.125,
        num_splits,
    )
    assert torch.equal(out, torch.zeros_like(out))


def test_store_kv_writes_slots_and_skips_padding():
    k = torch.randn(4, 2, 64, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    k_cache = torch.zeros(8, 16, 2, 64, device=DEVICE, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 17, -1, 127], device=DEVICE)
    tk.store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    for i, s in ((0, 5), (1, 17), (3, 127)):
        assert torch.equal(flat_k[s], k[i]) and torch.equal(flat_v[s], v[i])
    written = (flat_k != 0).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert written == [5, 17, 127]


@pytest.mark.parametrize(
    "batch, kv_heads, max_len, expected_min", [(1, 8, 4096, 2), (256, 8, 4096, 1)]
)
def test_split_heuristic(batch, kv_heads, max_len, expected_min):
    splits = td.decode_num_splits(batch, kv_heads, max_len, num_sms=132)
    assert expected_min <= splits <= 64
    assert splits <= -(-max_len // td.MIN_SPLIT_KEYS)


def test_batch_one_spreads_a_short_context_over_the_gpu():
    # Qwen3-0.6B at batch 1, 1024 tokens of context: 16 splits of one 64-key tile
    # (8 KV heads -> 128 programs on 132 SMs), not 4 splits of 4 tiles each.
    assert td.decode_num_splits(1, 8, 1024, num_sms=132) == 16
    # A graph planned for 40960 tokens asks for 33; a 1024-token context uses 16.
    assert td.decode_num_splits(1, 8, 40960, num_sms=132) == 33


MIXED_CASES = [
    # (q_lens with the decode rows first, prefix_lens, num_decode_seqs, prefill split)
    ([1, 1, 1, 9, 30], [40, 7, 90, 33, 0], 3, 0),
    ([1, 1, 12], [16, 64, 48], 2, 0),
    ([5, 1, 20], [3, 30, 0], 0, 0),  # a one-token chunk after a prefill: not a leading decode
    # A short prompt over a long cached prefix: the prefill split over its context
    # (2 splits of 310 keys on the CPU's 4 "SMs" and on an H200's 132).
    ([1, 1, 20], [16, 64, 600], 2, 2),
    ([1, 40], [50, 300], 1, 0),  # 340 keys: too few for two chunks, the unsplit kernel
    ([1, 40], [50, 500], 1, 2),
]


def mixed_step(q_lens, prefix_lens, num_decodes, heads=8, kv_heads=2, head_dim=64, block_size=16):
    """A random step of decodes then prefills: (q, k, v, k_cache, v_cache, meta)."""
    from engine.layers.attention import AttentionMetadata

    rng = random.Random(2)
    torch.manual_seed(2)
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens, strict=True)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    bt = random_layout(rng, q_lens, prefix_lens, block_size, num_blocks)
    total = sum(q_lens)
    q = torch.randn(total, heads, head_dim, device=DEVICE, dtype=DTYPE)
    k = torch.randn(total, kv_heads, head_dim, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    slots = []
    for i, (ql, p) in enumerate(zip(q_lens, prefix_lens, strict=True)):
        for pos in range(p, p + ql):
            slots.append(int(bt[i, pos // block_size]) * block_size + pos % block_size)
    qsl = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        num_seqs=len(q_lens),
        num_tokens=total,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        block_tables=bt,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_seqs=num_decodes,
    )
    return q, k, v, k_cache, v_cache, meta


@pytest.mark.parametrize("q_lens, prefix_lens, num_decodes, prefill_splits", MIXED_CASES)
def test_mixed_step_matches_torch_backend(q_lens, prefix_lens, num_decodes, prefill_splits):
    """A step of decodes then prefills: the triton backend runs the decode kernel on
    the leading one-token rows and the prefill kernel on the rest; the output must
    be the torch reference's for every row."""
    from engine.layers.attention.triton_backend import TritonAttention

    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    q, k, v, k_cache, v_cache, meta = mixed_step(q_lens, prefix_lens, num_decodes)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    triton_attn = TritonAttention(heads, kv_heads, head_dim, head_dim**-0.5, block_size)
    out = triton_attn.forward(q, k, v, k_cache, v_cache, meta)
    assert triton_attn._args[-1][0] == prefill_splits
    ref_attn = TorchAttention(heads, kv_heads, head_dim, head_dim**-0.5, block_size)
    ref = ref_attn.forward(q, k, v, ref_k, ref_v, meta)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.allclose(out.float(), ref.float(), atol=ATOL, rtol=ATOL), (
        (out.float() - ref.float()).abs().max()
    )


def free_blocks_before_windows(meta, k_cache, v_cache, window: int) -> int:
    """What the block manager does for a model whose layers all slide: the blocks
    wholly before every query's window are freed (entry -1; here their memory is
    NaN, as a reused or never-written block could hold). Returns how many."""
    freed = 0
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    bs = k_cache.shape[1]
    for i, seq_len in enumerate(lens):
        first_query = seq_len - (qsl[i + 1] - qsl[i])
        for j in range(max(0, first_query - window + 1) // bs):
            block = int(meta.block_tables[i, j])
            k_cache[block] = float("nan")
            v_cache[block] = float("nan")
            meta.block_tables[i, j] = -1
            freed += 1
    return freed


WINDOW_CASES = [
    # (q_lens, prefix_lens, num_decodes, window, soft cap)
    ([1, 1, 1, 9, 30], [40, 7, 90, 33, 0], 3, 24, None),
    ([1, 1, 12], [16, 200, 48], 2, 40, None),
    ([1, 40], [50, 500], 1, 64, 5.0),  # the prefill split gives way to the windowed kernel
    ([1, 1, 9, 30], [40, 7, 33, 0], 2, None, 2.0),
    ([3, 70], [0, 40], 0, 17, 3.0),
]


@pytest.mark.parametrize("q_lens, prefix_lens, num_decodes, window, cap", WINDOW_CASES)
def test_sliding_window_and_soft_cap_match_torch_backend(
    q_lens, prefix_lens, num_decodes, window, cap
):
    """Per-layer sliding windows (with the blocks before them freed and poisoned)
    and soft-capped scores, decode and prefill kernels against the torch backend."""
    from engine.layers.attention.triton_backend import TritonAttention

    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    q, k, v, k_cache, v_cache, meta = mixed_step(q_lens, prefix_lens, num_decodes)
    if window is not None:
        assert free_blocks_before_windows(meta, k_cache, v_cache, window) > 0
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kw = {"sliding_window": window, "logits_soft_cap": cap}
    scale = head_dim**-0.5
    out = TritonAttention(heads, kv_heads, head_dim, scale, block_size).forward(
        q, k, v, k_cache, v_cache, meta, **kw
    )
    ref = TorchAttention(heads, kv_heads, head_dim, scale, block_size).forward(
        q, k, v, ref_k, ref_v, meta, **kw
    )
    assert torch.isfinite(ref).all()
    assert torch.allclose(out.float(), ref.float(), atol=ATOL, rtol=ATOL), (
        (out.float() - ref.float()).abs().max()
    )
    plain = TorchAttention(heads, kv_heads, head_dim, scale, block_size)
    if window is None:  # the cap changes the result
        assert not torch.allclose(ref, plain.forward(q, k, v, ref_k, ref_v, meta), atol=ATOL)
