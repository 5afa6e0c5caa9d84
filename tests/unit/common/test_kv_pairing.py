"""The KV pairing between prefill and decode ranks of any tensor-parallel sizes."""

from __future__ import annotations

import pytest

from common.kv_transfer.pairing import KVPair, kv_pairs, receives_of, sends_of
from engine.tp_layout import kv_head_range

SIZES = [1, 2, 3, 4, 6, 8]
HEADS = [1, 2, 3, 4, 6, 8, 12, 16]


def _valid(h: int, t: int) -> bool:
    return h % t == 0 or t % h == 0


@pytest.mark.parametrize("heads", HEADS)
def test_every_receiving_rank_gets_exactly_its_heads_from_ranks_that_hold_them(heads):
    for a in (s for s in SIZES if _valid(heads, s)):
        for b in (s for s in SIZES if _valid(heads, s)):
            pairs = kv_pairs(heads, a, b)
            for j in range(b):
                got = [h for p in receives_of(pairs, j) for h in range(p.head_start, p.head_end)]
                assert got == list(kv_head_range(j, b, heads)), (a, b, j)
            for p in pairs:
                held = kv_head_range(p.sender, a, heads)
                assert p.head_start in held and p.head_end - 1 in held, (a, b, p)


def test_replicated_heads_are_spread_over_their_holders():
    # 2 KV heads on 4 prefill ranks (each head on two), to 4 decode ranks.
    pairs = kv_pairs(2, 4, 4)
    assert pairs == [KVPair(0, 0, 0, 1), KVPair(1, 1, 0, 1), KVPair(2, 2, 1, 2), KVPair(3, 3, 1, 2)]
    # ...and to one decode rank: one sender per head, consecutive heads not merged
    # across senders.
    assert kv_pairs(2, 4, 1) == [KVPair(0, 0, 0, 1), KVPair(2, 0, 1, 2)]


def test_the_demo_models_three_heads_between_tp_3_and_1():
    assert kv_pairs(3, 3, 1) == [KVPair(0, 0, 0, 1), KVPair(1, 0, 1, 2), KVPair(2, 0, 2, 3)]
    assert kv_pairs(3, 1, 3) == [KVPair(0, 0, 0, 1), KVPair(0, 1, 1, 2), KVPair(0, 2, 2, 3)]
    assert kv_pairs(3, 1, 1) == [KVPair(0, 0, 0, 3)]
    assert sends_of(kv_pairs(3, 3, 1), 2) == [KVPair(2, 0, 2, 3)]


@pytest.mark.parametrize("heads, size", [(3, 2), (8, 3), (4, 0), (8, 16)])
def test_sizes_that_cannot_hold_the_heads_are_refused(heads, size):
    with pytest.raises(ValueError, match="tensor-parallel size"):
        kv_pairs(heads, size, 1)
