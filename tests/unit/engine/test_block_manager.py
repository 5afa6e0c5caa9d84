"""Block manager: reference counts, verified prefix hits, LRU reuse, free + used == total."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_hash import ROOT_HASH
from engine.block_manager import BlockManager
from tests.unit.engine.helpers import make_seq

BS = 4


def computed(bm: BlockManager, seq, num_tokens: int | None = None) -> None:
    """Allocate for the whole sequence, mark it computed, register its blocks."""
    n = seq.num_tokens if num_tokens is None else num_tokens
    prefix = bm.find_cached_prefix(seq)
    assert bm.allocate_slots(seq, n - len(prefix) * BS, prefix)
    seq.num_computed_tokens = n
    bm.cache_full_blocks(seq)
    bm.check_invariants()


def test_allocate_and_free_keep_the_pool_consistent():
    bm = BlockManager(10, BS)
    seq = make_seq(10, BS)
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 7 and bm.num_used_blocks == 3
    bm.check_invariants()
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []
    bm.check_invariants()
    bm.free(seq)  # idempotent: a freed sequence holds nothing
    assert bm.num_free_blocks == 10


def test_allocation_failure_changes_nothing():
    bm = BlockManager(3, BS)
    a = make_seq(8, BS)
    assert bm.allocate_slots(a, 8)
    b = make_seq(12, BS)
    assert not bm.allocate_slots(b, 12)
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants()


def test_growth_allocates_only_when_a_block_fills():
    bm = BlockManager(4, BS)
    seq = make_seq(4, BS)
    assert bm.allocate_slots(seq, 4)
    seq.num_computed_tokens = 4
    seq.token_ids.append(7)
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    seq.token_ids.append(8)
    assert bm.allocate_slots(seq, 1)
    assert len(seq.block_table) == 2


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(20, BS)
    a = make_seq(list(range(18)), BS)
    computed(bm, a)
    assert bm.num_cached_blocks == 4  # 18 tokens: 4 full blocks
    b = make_seq(list(range(16)) + [99, 98, 97], BS)
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:4]
    assert bm.allocate_slots(b, b.num_tokens - 16, hits)
    assert b.num_computed_tokens == 16 and b.num_cached_blocks == 4
    assert all(bm.blocks[i].ref_count == 2 for i in hits)
    bm.check_invariants()
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in hits)
    bm.free(b)
    assert bm.num_free_blocks == 20
    bm.check_invariants()


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(20, BS)
    a = make_seq(list(range(16)), BS)
    computed(bm, a)
    same = make_seq(list(range(16)), BS)
    # 16 tokens = 4 full blocks, but at most (16 - 1) // 4 = 3 may hit.
    assert len(bm.find_cached_prefix(same)) == 3


def test_freed_cached_blocks_are_revived_by_a_hit():
    bm = BlockManager(6, BS)
    a = make_seq(list(range(12)), BS)
    computed(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_free_blocks == 3 and bm.num_free_blocks == 6
    b = make_seq(list(range(12)) + [5], BS)
    hits = bm.find_cached_prefix(b)
    assert hits == table
    assert bm.allocate_slots(b, 1, hits)
    assert bm.num_cached_free_blocks == 0
    assert bm.num_free_blocks == 6 - 4
    bm.check_invariants()


def test_uncached_blocks_are_reused_before_cached_ones_then_lru():
    bm = BlockManager(6, BS)
    a = make_seq(list(range(8)), BS)  # 2 cached blocks
    computed(bm, a)
    b = make_seq(list(range(50, 58)), BS)  # 2 more cached blocks
    computed(bm, b)
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    c = make_seq(8, BS, hashed=False)
    assert bm.allocate_slots(c, 8)  # 2 never-cached blocks are left: take those
    assert bm.num_cached_blocks == 4
    d = make_seq(4, BS, hashed=False)
    assert bm.allocate_slots(d, 4)  # now evict: a's tail block goes first
    assert bm.num_cached_blocks == 3
    a2 = make_seq(list(range(8)) + [1], BS)
    assert len(bm.find_cached_prefix(a2)) == 1  # a's first block survived
    b2 = make_seq(list(range(50, 58)) + [1], BS)
    assert len(bm.find_cached_prefix(b2)) == 2
    bm.check_invariants()


def test_one_allocation_takes_uncached_then_lru_blocks_in_order_and_reports_evictions():
    # A prompt takes all its blocks in one allocation (in bulk): the never-cached
    # ones first, then cached ones least recently freed first, each unhashed;
    # the prompt holds them in ascending order (runs for a KV transfer's copies).
    bm = BlockManager(7, BS, record_events=True)
    a = make_seq(list(range(12)), BS)  # 3 cached blocks
    b = make_seq(list(range(50, 58)), BS)  # 2 more
    computed(bm, a)
    computed(bm, b)
    bm.take_events()
    uncached = list(bm._free_uncached)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(b)  # b first: its blocks are the least recently freed
    bm.free(a)
    lru = list(bm._free_cached)
    assert lru == b_blocks[::-1] + a_blocks[::-1]  # tails first, as freed
    c = make_seq(24, BS, hashed=False)
    assert bm.allocate_slots(c, 20)  # 5 blocks: 2 never cached, then 3 from the LRU
    assert c.block_table == sorted(uncached + lru[:3])
    assert all(bm.blocks[i].ref_count == 1 for i in c.block_table)
    removed = bm.take_events().removed
    assert set(removed) == set(b.block_hashes[:2]) | {a.block_hashes[2]}
    again = make_seq(list(range(12)) + [1], BS)
    assert len(bm.find_cached_prefix(again)) == 2  # a's first two blocks survived
    bm.check_invariants()
    assert_prefix_closed(bm)


def test_blocks_freed_tail_first_come_back_as_one_ascending_run():
    # A freed prompt's blocks sit in the pools in descending order; the next
    # prompt of that size gets them back ascending: one run of consecutive ids.
    bm = BlockManager(16, BS)
    a = make_seq(list(range(4 * BS)), BS)
    computed(bm, a)
    first = list(a.block_table)
    assert first == list(range(first[0], first[0] + 4))
    filler = make_seq(12 * BS, BS, hashed=False)
    assert bm.allocate_slots(filler, 12 * BS)  # the never-cached blocks, all of them
    bm.free(a)
    assert list(bm._free_cached) == first[::-1]
    b = make_seq(4 * BS, BS, hashed=False)
    assert bm.allocate_slots(b, 4 * BS)
    assert b.block_table == first
    bm.check_invariants()


def test_hash_hit_with_different_tokens_is_rejected():
    bm = BlockManager(10, BS)
    a = make_seq(list(range(12)), BS)
    computed(bm, a)
    # Corrupt the cached block's recorded tokens: its hash no longer matches content.
    bm.blocks[a.block_table[1]].token_ids = (0, 0, 0, 0)
    b = make_seq(list(range(12)) + [3], BS)
    assert len(bm.find_cached_prefix(b)) == 1
    assert bm.num_verification_failures == 1


def test_double_free_is_detected():
    bm = BlockManager(4, BS)
    a = make_seq(4, BS)
    assert bm.allocate_slots(a, 4)
    alias = make_seq(4, BS)
    alias.block_table = list(a.block_table)  # a bug elsewhere: shared without a reference
    bm.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(alias)


def test_events_and_reset():
    bm = BlockManager(10, BS, record_events=True)
    a = make_seq(list(range(12)), BS)
    computed(bm, a)
    ev = bm.take_events()
    assert ev.stored == a.block_hashes[:3] and ev.removed == []
    bm.free(a)
    assert bm.reset_prefix_cache() == 3
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 10
    assert set(bm.take_events().removed) == set(a.block_hashes[:3])
    bm.check_invariants()


def test_duplicate_content_is_held_by_both_blocks():
    bm = BlockManager(10, BS)
    a = make_seq(list(range(8)), BS)
    b = make_seq(list(range(8)), BS)
    for s in (a, b):  # both computed before either was cached
        assert bm.allocate_slots(s, 8)
        s.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert bm.num_cached_blocks == 2  # two distinct hashes, each held twice
    hit = make_seq(list(range(8)) + [1], BS)
    assert bm.find_cached_prefix(hit) == a.block_table  # hits go to the first holder
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_free_blocks == 4 and bm.num_free_blocks == 10
    bm.check_invariants()


def test_a_hash_outlives_its_first_holder_so_the_cache_stays_prefix_closed():
    # a and b prefill the same 2-block prefix at once; b goes on and caches a
    # third block. When a's blocks are evicted the prefix must stay cached
    # (b's copies hold it), or b's third block would be cached without its parent.
    bm = BlockManager(6, BS, record_events=True)
    a = make_seq(list(range(8)), BS)
    b = make_seq(list(range(12)), BS)
    for s in (a, b):
        assert bm.allocate_slots(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    bm.free(a)
    filler = make_seq(12, BS, hashed=False)
    assert bm.allocate_slots(filler, 12)  # the free block, then a's two cached ones
    assert bm.num_free_blocks == 0
    bm.check_invariants()
    assert bm.num_cached_blocks == 3
    assert not bm.take_events().removed  # nothing was ever un-cached
    again = make_seq(list(range(12)) + [5], BS)
    assert bm.find_cached_prefix(again) == b.block_table  # now served by b's blocks
    assert_prefix_closed(bm)


def test_a_flush_evicts_only_blocks_no_request_holds():
    bm = BlockManager(10, BS, record_events=True)
    a = make_seq(list(range(8)), BS)
    b = make_seq(list(range(50, 58)), BS)
    computed(bm, a)
    computed(bm, b)
    bm.take_events()
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert set(bm.take_events().removed) == set(a.block_hashes[:2])
    assert bm.num_cached_blocks == 2  # b's, still in use
    bm.free(b)
    assert bm.reset_prefix_cache() == 2 and bm.num_cached_blocks == 0
    bm.check_invariants()


def assert_prefix_closed(bm: BlockManager) -> None:
    cached = set(bm._hash_to_block)
    for block_id in bm._hash_to_block.values():
        parent = bm.blocks[block_id].parent_hash
        assert parent == ROOT_HASH or parent in cached, "a cached block's parent is not cached"


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / free / reset sequences: invariants hold throughout."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(16, BS)
        self.live = []

    @rule(prefix=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, prefix):
        seq = make_seq(prefix, BS)
        hits = self.bm.find_cached_prefix(seq)
        if self.bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits):
            seq.num_computed_tokens = seq.num_tokens
            self.bm.cache_full_blocks(seq)
            self.live.append(seq)
        else:
            assert seq.block_table == []

    @rule(prefix=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit_without_hits(self, prefix):
        # Two requests prefilling one prefix at once: neither saw the other's blocks.
        seq = make_seq(prefix, BS)
        if self.bm.allocate_slots(seq, seq.num_tokens):
            seq.num_computed_tokens = seq.num_tokens
            self.bm.cache_full_blocks(seq)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(data.draw(st.integers(0, 2)))
        if self.bm.allocate_slots(seq, 1):
            seq.num_computed_tokens += 1
            self.bm.cache_full_blocks(seq)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        assert_prefix_closed(self.bm)
        holders: dict[int, int] = {}
        for seq in self.live:
            assert len(seq.block_table) == -(-seq.num_tokens // BS)
            for b in seq.block_table:
                holders[b] = holders.get(b, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The same, with blocks freed behind a 6-token sliding window as sequences
    grow (a model whose layers all slide): the books still balance; the cache
    need not stay prefix-closed (engine/block_manager.py says why)."""

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def slide(self, data):
        seq = data.draw(st.sampled_from(self.live))
        before = self.bm.num_free_blocks
        freed = self.bm.free_blocks_before(seq, seq.num_computed_tokens - 6 + 1)
        assert self.bm.num_free_blocks >= before  # shared blocks may stay in use
        assert freed >= 0

    @invariant()
    def consistent(self):
        from engine.block_manager import NO_BLOCK

        self.bm.check_invariants()
        holders: dict[int, int] = {}
        for seq in self.live:
            assert len(seq.block_table) == -(-seq.num_tokens // BS)
            table = seq.block_table
            assert table[: seq.num_window_freed_blocks] == [NO_BLOCK] * seq.num_window_freed_blocks
            for b in table[seq.num_window_freed_blocks :]:
                holders[b] = holders.get(b, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)


TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
