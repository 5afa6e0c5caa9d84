"""Tensor-parallel sharding arithmetic and the per-step hand-off's wire form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.lora.request import LoRARequest
from engine.parallel.handoff import (
    LORA_LOAD_BYTES,
    Logits,
    Op,
    StepPlan,
    decode,
    encode,
    max_plan_words,
)
from engine.step_inputs import host_inputs
from engine.tp_layout import TPLayout, check_tensor_parallel_size


def layout(rank, size, heads=8, kv=2, inter=256, vocab=501):
    return TPLayout(rank, size, heads, kv, 16, inter, vocab)


def test_heads_split_evenly_when_kv_heads_divide():
    parts = [layout(r, 2) for r in range(2)]
    assert [list(p.q_heads) for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(p.kv_heads) for p in parts] == [[0], [1]]
    assert not parts[0].kv_replicated and parts[0].num_local_kv_heads == 1


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    parts = [layout(r, 4) for r in range(4)]
    assert all(p.kv_replicated and p.num_local_kv_heads == 1 for p in parts)
    # Query heads 0-1 and 2-3 read KV head 0 (group of 4), 4-7 read head 1.
    assert [list(p.kv_heads) for p in parts] == [[0], [0], [1], [1]]
    for p in parts:
        group = p.num_heads // p.num_kv_heads
        assert {h // group for h in p.q_heads} == set(p.kv_heads)
    assert parts[0].kv_head_ranks(0) == [0, 1] and parts[0].kv_head_ranks(1) == [2, 3]


def test_demo_model_shape_at_three_ranks():
    parts = [layout(r, 3, heads=9, kv=3, inter=1536, vocab=49152) for r in range(3)]
    assert [list(p.kv_heads) for p in parts] == [[0], [1], [2]]
    assert [p.intermediate_range for p in parts] == [
        range(0, 512),
        range(512, 1024),
        range(1024, 1536),
    ]
    assert [p.vocab_range for p in parts] == [
        range(0, 16384),
        range(16384, 32768),
        range(32768, 49152),
    ]


def test_vocab_shards_pad_the_last_rank():
    parts = [layout(r, 4) for r in range(4)]  # 501 = 4 x 126 - 3
    assert {p.vocab_shard_size for p in parts} == {126}
    assert [len(p.vocab_range) for p in parts] == [126, 126, 126, 123]
    assert parts[-1].vocab_range.stop == 501


@pytest.mark.parametrize(
    ("size", "match"),
    [
        (0, "between 1 and 8"),
        (9, "between 1 and 8"),
        (3, "divide the model's 8 attention heads"),
        (8, None),
    ],
)
def test_sizes_checked_with_a_reason(size, match):
    if match is None:
        check_tensor_parallel_size(size, 8, 2, 256)
        return
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel_size(size, 8, 2, 256)


def test_kv_heads_must_divide_or_be_divided():
    with pytest.raises(ValueError, match="one must divide the other"):
        check_tensor_parallel_size(4, 12, 6, 256)  # 6 KV heads over 4 ranks
    with pytest.raises(ValueError, match="intermediate size"):
        check_tensor_parallel_size(2, 8, 2, 255)


def test_step_plan_round_trips_through_its_words():
    host = host_inputs(
        [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [0, 1, 2], [4, 1, 1], [[3], [4, 5], [6]], 2
    )
    plan = StepPlan(
        host,
        patched=True,
        use_graph=False,
        logits=Logits.ROWS,
        logit_rows=np.array([3, 4, 5], dtype=np.int64),
        prompt_slices=[(0, 3)],
    )
    header, payload = encode(plan)
    assert header.dtype == np.int64 and payload.dtype == np.int64  # plain words, no pickle
    got = decode(header, payload)
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping"):
        assert np.array_equal(getattr(got.host, name), getattr(host, name)), name
    assert np.array_equal(got.host.block_tables, host.block_tables)
    assert got.host.block_tables.dtype == np.int32
    assert got.patched and not got.use_graph and got.logits is Logits.ROWS
    assert got.logit_rows.tolist() == [3, 4, 5] and got.prompt_slices == [(0, 3)]


def test_a_decode_plan_without_extras_round_trips():
    host = host_inputs([[1, 2], [3, 4, 5]], [1, 2], [1, 1], [[0], [1]], 16)
    got = decode(*encode(StepPlan(host, use_graph=True, logits=Logits.ALL)))
    assert got.logits is Logits.ALL and got.logit_rows is None and got.use_graph
    assert got.prompt_slices == [] and got.host.input_ids.tolist() == [2, 5]


def test_a_verify_and_a_draft_plan_fit_the_channel_and_round_trip():
    # Two sequences verifying three proposed tokens each: every position gives
    # logits, more rows than sequences; the channel is sized by tokens.
    host = host_inputs([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [1, 1], [4, 4], [[0], [1]], 16)
    rows = np.arange(8, dtype=np.int64)
    verify = StepPlan(host, logits=Logits.ROWS, logit_rows=rows)
    # Every other part at its bound too: prompt slices, LoRA slots and loads.
    full = StepPlan(host, logits=Logits.ROWS, logit_rows=rows, prompt_slices=[(0, 1)] * 3)
    full.lora_slots = np.zeros(8, dtype=np.int32)
    empty = len(json.dumps([[0, "a", 1, ""]]))
    full.lora_loads = [(0, LoRARequest("a", 1, "p" * (LORA_LOAD_BYTES - empty)))]
    header, payload = encode(full)
    assert len(header) + len(payload) <= max_plan_words(8, 2, 1)
    header, payload = encode(verify)
    assert decode(header, payload).logit_rows.tolist() == rows.tolist()
    # A draft model's forward travels as its own op, the same words otherwise.
    draft = StepPlan(host, logits=Logits.ROWS, logit_rows=np.array([3, 7]), draft=True)
    header, payload = encode(draft)
    assert header[0] == Op.DRAFT
    got = decode(header, payload)
    assert got.draft and not decode(*encode(verify)).draft
    assert got.logit_rows.tolist() == [3, 7]
