"""The KV stream's wire format, its ordering rule, and the decode side's coverage check."""

from __future__ import annotations

import pytest
import torch

from common.kv_transfer.coverage import Coverage
from common.kv_transfer.protocol import (
    FLAG_LOGPROBS,
    FLAG_TOKEN,
    HEADER_BLOCK,
    HEADER_WORDS,
    MAGIC,
    ChunkDesc,
    FirstToken,
    SegmentHeader,
    first_token_words,
    group_messages,
    header_message_rows,
    header_words,
    parse_first_token,
    token_message_bytes,
    token_order,
    wire_order,
)
from common.version import PROTOCOL_VERSION
from engine.kv_blocks import gather_blocks, kv_unit_bytes, scatter_blocks


def seg(rid=5, b0=0, b1=2, layers=(0, 4), per_chunk=4, heads=(0, 2), unit=256, **kw):
    return SegmentHeader(rid, b0, b1, *layers, per_chunk, *heads, unit, **kw)


def test_header_round_trip_and_rejection():
    h = SegmentHeader(2**40 + 3, 12, 99, 0, 80, 3, 2, 6, 8192, group_size=3, group_index=2)
    assert SegmentHeader.from_tensor(h.to_tensor()) == h
    assert h.to_tensor().shape == (HEADER_WORDS,)
    end = SegmentHeader.end(77)
    assert SegmentHeader.from_tensor(end.to_tensor()) == end and end.is_end
    assert end.chunks() == [] and end.num_bytes == 0
    bad = h.to_tensor()
    bad[0] = 1
    with pytest.raises(ValueError, match="not a KV segment header"):
        SegmentHeader.from_tensor(bad)
    # Another protocol version's header names both.
    bad[0] = MAGIC + 1
    with pytest.raises(ValueError, match=f"of protocol version {PROTOCOL_VERSION}"):
        SegmentHeader.from_tensor(bad)
    assert MAGIC & 0xFFFF == PROTOCOL_VERSION
    for field, value in [
        (2, 200),  # block_start past block_end
        (5, 1 << 13),  # absurd layer count
        (9, 0),  # no unit size
        (11, 3),  # group_index == group_size
        (12, 4),  # unknown flag
    ]:
        bad = h.to_tensor()
        bad[field] = value
        with pytest.raises(ValueError, match="out of bounds"):
            SegmentHeader.from_tensor(bad)


def test_a_groups_headers_travel_as_a_block_and_those_past_it_in_one_more():
    few = [seg(rid=r).with_group(3, i) for i, r in enumerate((1, 2, 3))]
    words, sizes = header_words(few)
    assert sizes == [HEADER_BLOCK] and words.shape == (HEADER_BLOCK, HEADER_WORDS)
    (block,) = words.split(sizes)
    assert [SegmentHeader.from_tensor(row) for row in block[:3]] == few
    assert not block[3:].any()  # zero rows after the last header
    many = [seg(rid=r).with_group(HEADER_BLOCK + 2, r) for r in range(HEADER_BLOCK + 2)]
    words, sizes = header_words(many)
    block, rest = words.split(sizes)
    assert rest.shape == (2, HEADER_WORDS)
    assert [SegmentHeader.from_tensor(row) for row in [*block, *rest]] == many
    # The receiver's side of the same rule: the first message before it knows k.
    assert header_message_rows(1) == [HEADER_BLOCK]
    assert header_message_rows(HEADER_BLOCK) == [HEADER_BLOCK]
    assert header_message_rows(HEADER_BLOCK + 1) == [HEADER_BLOCK, 1]


def test_a_first_token_header_round_trips_and_adds_one_message_after_the_chunks():
    h = seg(rid=9, flags=FLAG_TOKEN, cached_tokens=48)
    assert h.has_token and SegmentHeader.from_tensor(h.to_tensor()) == h
    plain = seg(rid=8, layers=(0, 4), per_chunk=2)
    assert token_order([plain, h, seg(rid=7, flags=FLAG_TOKEN)]) == [1, 2]
    # Its chunks as without the flag; one message more per token, after them.
    assert h.chunks() == seg(rid=9).chunks()
    assert group_messages([plain, h]) == len(wire_order([plain, h])) + 1 == 4
    for field, value in [
        (12, FLAG_TOKEN | 1),  # an end header never carries a token
        (12, FLAG_LOGPROBS),  # logprobs without a token
        (13, 5),  # a cache hit without a token
        (13, -1),
        (14, 3),  # best tokens without logprobs
    ]:
        bad = (h if field in (12, 14) else seg()).to_tensor()
        bad[field] = value
        with pytest.raises(ValueError, match="out of bounds"):
            SegmentHeader.from_tensor(bad)


def test_a_first_token_message_carries_its_logprobs_as_its_header_sizes_it():
    plain = seg(rid=9, flags=FLAG_TOKEN, cached_tokens=4)
    words = first_token_words(torch.tensor([42]))
    assert words.numel() * 8 == token_message_bytes(plain) == 8
    assert parse_first_token(plain, words.numpy().tobytes()) == FirstToken(42, 4)
    h = seg(rid=9, flags=FLAG_TOKEN | FLAG_LOGPROBS, cached_tokens=4, top_logprobs=2)
    assert SegmentHeader.from_tensor(h.to_tensor()) == h
    logprobs = (
        torch.tensor(-0.75, dtype=torch.float32),
        torch.tensor(3),
        torch.tensor([5, 6]),
        torch.tensor([-0.125, -0.5], dtype=torch.float32),
    )
    words = first_token_words(torch.tensor([42]), logprobs)
    assert words.dtype == torch.int64 and words.numel() * 8 == token_message_bytes(h) == 7 * 8
    token = parse_first_token(h, words.numpy().tobytes())
    assert token == FirstToken(42, 4, (-0.75, 3, [5, 6], [-0.125, -0.5]))


def test_an_end_header_carries_the_chunks_checksum():
    digest = bytes(range(16))
    end = SegmentHeader.end(77, (0, 2), digest)
    assert SegmentHeader.from_tensor(end.to_tensor()) == end
    assert SegmentHeader.from_tensor(SegmentHeader.end(77).to_tensor()).digest == b""


def test_chunks_split_layers_in_order_and_size_by_units():
    h = seg(layers=(0, 6), per_chunk=4)
    assert [(c.layer_start, c.layer_end) for c in h.chunks()] == [(0, 4), (4, 6)]
    assert all((c.block_start, c.block_end, c.heads) == (0, 2, (0, 2)) for c in h.chunks())
    assert h.num_bytes == 6 * 2 * 2 * 256


def test_wire_order_is_chunk_major_then_header_order():
    a = seg(rid=1, layers=(0, 6), per_chunk=2)  # 3 chunks
    b = seg(rid=2, layers=(0, 6), per_chunk=3)  # 2 chunks
    order = wire_order([a, b])
    assert [(i, d.layer_start) for i, d in order] == [(0, 0), (1, 0), (0, 2), (1, 3), (0, 4)]
    assert wire_order([SegmentHeader.end(3)]) == []


def test_coverage_accepts_splits_by_blocks_layers_and_heads_and_completes():
    unit = 256
    cov = Coverage(first_block=2, num_blocks=5, num_layers=4, heads=(0, 2), unit_bytes=unit)
    assert cov.units_left == 3 * 4 * 2
    parts = [
        seg(b0=2, b1=4, layers=(0, 4), heads=(0, 2)),  # a first prefill step
        seg(b0=4, b1=5, layers=(0, 2), heads=(0, 1)),  # the rest, split by layers and heads
        seg(b0=4, b1=5, layers=(0, 2), heads=(1, 2)),
        seg(b0=4, b1=5, layers=(2, 4), heads=(0, 2)),
    ]
    done = []
    for h in parts:
        assert cov.accept(h) is None
        done += [cov.land(c) for c in h.chunks()]
    assert done[-1] and not any(done[:-1]) and cov.units_left == 0


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (seg(b0=1, b1=3), "outside the reservation"),
        (seg(b0=3, b1=5), "do not continue"),  # a gap: block 2 never came
        (seg(b0=2, b1=4, layers=(0, 9)), "this model has 4"),
        (seg(b0=2, b1=4, heads=(1, 3)), "this node holds 0..2"),
        (seg(b0=2, b1=4, unit=512), "layouts differ"),
    ],
)
def test_coverage_rejects_what_does_not_fit(header, message):
    cov = Coverage(2, 5, 4, (0, 2), 256)
    error = cov.accept(header)
    assert error is not None and message in error
    assert cov.units_left == 3 * 4 * 2
    assert cov.accept(seg(b0=2, b1=5, layers=(0, 4))) is None  # nothing had changed


def test_coverage_rejects_a_segment_twice():
    cov = Coverage(0, 2, 4, (0, 2), 256)
    h = seg(b0=0, b1=2, layers=(0, 4))
    assert cov.accept(h) is None
    assert "do not continue" in cov.accept(h)


def test_gather_and_scatter_by_layer_and_head_ranges_move_exactly_those_bytes():
    kv = torch.randn(2, 5, 10, 4, 3, 8)
    src, dst_ids = [7, 2, 5], [1, 2, 3]
    dst = torch.zeros_like(kv)
    for layers in ((0, 2), (2, 5)):
        for heads in ((0, 1), (1, 3)):
            data = gather_blocks(kv, src, layers, heads)
            assert data.is_contiguous() and data.shape == (
                2,
                layers[1] - layers[0],
                3,
                4,
                heads[1] - heads[0],
                8,
            )
            desc = ChunkDesc(*layers, 0, 3, *heads)
            assert data.numel() * data.element_size() == desc.units * kv_unit_bytes(kv)
            scatter_blocks(dst, dst_ids, data.view(-1).view(torch.uint8), layers, heads)
    assert torch.equal(dst[:, :, dst_ids], kv[:, :, src])
    untouched = [b for b in range(10) if b not in dst_ids]
    assert not dst[:, :, untouched].any()
    with pytest.raises(ValueError, match="elements"):
        scatter_blocks(dst, dst_ids, torch.zeros(5), (0, 2), (0, 1))
