"""HostTier (pure Python) and the scheduler's host-tier paths: spills, hits, swaps."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.config import PreemptionMode
from engine.host_tier import HostTier
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, SequenceStatus
from tests.unit.engine.helpers import make_seq

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def spill_chain(tier: HostTier, hashes: list[int], first_block: int = 0) -> None:
    """Spill a chain of blocks (each the parent of the next) and land the copies."""
    for n, i in enumerate(hashes):
        parent = h(hashes[n - 1]) if n else h(0)
        tier.spill(h(i), parent, (i,) * BS, first_block + n)
    tier.landed(tier.take_copies())


def test_spilled_slots_are_evicted_least_recently_used_first():
    tier = HostTier(3)
    spill_chain(tier, [1, 2, 3])
    assert tier.lru_hashes() == [h(1), h(2), h(3)]
    # A repeated spill of a hash it holds only refreshes it.
    tier.spill(h(1), h(0), (1,) * BS, 9)
    assert not tier.take_copies()
    assert tier.lru_hashes() == [h(2), h(3), h(1)]
    # A hit that is loaded refreshes it too, once its copy is issued.
    tier.hold([tier._hash_to_slot[h(2)]])
    tier.load([tier._hash_to_slot[h(2)]], [5])
    tier.copies_issued(tier.take_copies())
    assert tier.lru_hashes() == [h(3), h(1), h(2)]
    spill_chain(tier, [4, 5])  # needs two slots: 3 and 1 go
    assert tier.lru_hashes() == [h(2), h(4), h(5)]
    assert tier.num_cached_slots == 3
    tier.check_invariants()


def test_a_spill_is_no_hit_until_its_copy_landed_and_hits_are_verified():
    tier = HostTier(4)
    tokens = [1] * BS + [2] * BS + [3] * BS
    hashes = [h(1), h(2), h(3)]
    tier.spill(h(1), h(0), (1,) * BS, 0)
    tier.spill(h(2), h(1), (2,) * BS, 1)
    assert tier.find_prefix(hashes, tokens, BS, 0, 3) == []  # still landing
    copies = tier.take_copies()
    assert copies.to_host == [(0, 0), (1, 1)]
    tier.landed(copies)
    assert tier.find_prefix(hashes, tokens, BS, 0, 3) == [0, 1]
    assert tier.find_prefix(hashes, tokens, BS, 1, 3) == [1]  # continuing a device hit
    wrong = [1] * BS + [9] * BS + [3] * BS  # same hashes, other tokens: a collision
    assert tier.find_prefix(hashes, wrong, BS, 0, 3) == [0]
    tier.check_invariants()


def test_held_and_landing_slots_are_never_evicted_and_swap_out_is_all_or_nothing():
    tier = HostTier(3)
    spill_chain(tier, [1])
    tier.hold([0])
    tier.spill(h(2), h(0), (2,) * BS, 1)  # landing
    assert tier.swap_out([7, 8]) is None  # one slot free, two asked: nothing changes
    assert tier.num_free_slots == 1
    slots = tier.swap_out([7])
    assert slots == [2]
    tier.spill(h(3), h(0), (3,) * BS, 3)  # every slot held or landing: not kept
    assert tier.stats.spills_skipped == 1
    copies = tier.take_copies()
    assert copies.to_host == [(1, 1), (7, 2)]
    tier.landed(copies)
    tier.release([0])
    tier.release(slots)  # the swapped sequence finished: its slot is empty again
    assert tier.num_free_slots == 3 and tier.num_cached_slots == 2
    with pytest.raises(RuntimeError, match="double release"):
        tier.release(slots)
    tier.check_invariants()


def test_a_flush_empties_both_tiers_and_spills_nothing():
    tier = HostTier(4)
    bm = BlockManager(4, BS, host_tier=tier)
    seq = make_seq(9, BS)  # two full blocks and a token
    bm.allocate_slots(seq, 9)
    bm.cache_full_blocks(seq, 9)
    bm.free(seq)
    spill_chain(tier, [1, 2], first_block=2)
    assert bm.reset_prefix_cache() == 2 + 2
    assert not tier.take_copies()
    assert tier.num_cached_slots == 0 and tier.num_free_slots == 4
    bm.check_invariants()
    tier.check_invariants()


def make(num_blocks, slots, mode=PreemptionMode.RECOMPUTE, max_seqs=8):
    tier = HostTier(slots)
    bm = BlockManager(num_blocks, BS, host_tier=tier)
    return Scheduler(bm, max_seqs, 64, 256, preemption_mode=mode), tier


def run_step(sched: Scheduler, tier: HostTier):
    """Schedule, do the copies at once (a CPU engine), pretend the model ran."""
    batch = sched.schedule()
    loads = sched.take_new_loads()
    tier.copies_issued(copies := tier.take_copies())
    tier.landed(copies)
    sched.update(batch, [1 if s.num_computed_tokens + n == s.num_tokens else None
                         for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)])  # fmt: skip
    sched.loads_done(loads)
    sched.block_manager.check_invariants()
    tier.check_invariants()
    return batch, copies


def land_copies(sched: Scheduler, tier: HostTier) -> None:
    """The copies queued so far land; the loads among them are done."""
    loads = sched.take_new_loads()
    tier.copies_issued(copies := tier.take_copies())
    tier.landed(copies)
    sched.loads_done(loads)


def finish_all(sched: Scheduler) -> None:
    for seq in list(sched.running):
        sched.finish(seq, FinishReason.STOP)


def test_an_evicted_prefix_spills_and_a_later_prompt_loads_it_back():
    sched, tier = make(num_blocks=4, slots=8)
    first = make_seq(list(range(100, 113)), BS)  # 3 full blocks + 1 token
    sched.add(first)
    run_step(sched, tier)
    finish_all(sched)
    other = make_seq(13, BS)  # evicts first's cached blocks
    sched.add(other)
    _, copies = run_step(sched, tier)
    assert len(copies.to_host) == 3 and tier.num_cached_slots == 3
    finish_all(sched)
    again = make_seq(list(range(100, 113)) + [7, 8, 9], BS)
    sched.add(again)
    batch, copies = run_step(sched, tier)
    assert again not in batch.seqs  # it waited for its copies
    assert sorted(s for s, _ in copies.to_device) == [0, 1, 2]
    assert again.status is SequenceStatus.RUNNING and again.num_computed_tokens == 12
    assert again.num_cached_tokens == 12 and tier.stats.hit_blocks == 3
    batch, _ = run_step(sched, tier)
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)] == [
        (again.seq_id, 4)
    ]
    finish_all(sched)
    assert sched.block_manager.num_free_blocks == 4 and tier.num_free_slots == 8


def test_a_load_holds_up_only_its_own_sequence():
    sched, tier = make(num_blocks=8, slots=8)
    prompt = list(range(300, 313))
    seeded = make_seq(prompt, BS)
    seeded.update_block_hashes()
    for i, block_hash in enumerate(seeded.block_hashes):  # the tier holds its 3 full blocks
        parent = seeded.block_hashes[i - 1] if i else bytes(16)
        tier.spill(block_hash, parent, tuple(prompt[i * BS : (i + 1) * BS]), i)
    tier.landed(tier.take_copies())
    other = make_seq(6, BS)
    sched.add(other)
    run_step(sched, tier)
    again = make_seq(prompt, BS)
    sched.add(again)
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == [other.seq_id]  # other decodes meanwhile
    assert again.status is SequenceStatus.LOADING and sched.take_new_loads() == [again]
    assert len(tier.take_copies().to_device) == 3


def test_swap_preemption_parks_blocks_and_resumes_without_recompute():
    sched, tier = make(num_blocks=6, slots=8, mode=PreemptionMode.SWAP)
    a, b = make_seq(12, BS), make_seq(12, BS)
    sched.add(a)
    sched.add(b)
    run_step(sched, tier)  # 3 blocks each: the pool is full
    batch, copies = run_step(sched, tier)  # a's 13th token needs a block: b swaps out
    assert b.status is SequenceStatus.SWAPPED and b.num_computed_tokens == 12
    # b's 3 blocks, and the cached one of b's that a's new block evicted.
    assert len(copies.to_host) == 4 and sched.stats.num_swap_preemptions == 1
    sched.finish(a, FinishReason.STOP)
    batch, copies = run_step(sched, tier)  # b loads back
    assert [d for _, d in copies.to_device] == b.block_table and b not in batch.seqs
    batch, _ = run_step(sched, tier)
    assert [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)] == [
        (b.seq_id, 1)
    ]
    finish_all(sched)
    assert sched.block_manager.num_free_blocks == 6 and tier.num_free_slots == 8


def test_swap_falls_back_to_recompute_when_the_tier_is_full():
    sched, tier = make(num_blocks=6, slots=2, mode=PreemptionMode.SWAP)
    a, b = make_seq(12, BS), make_seq(12, BS)
    sched.add(a)
    sched.add(b)
    run_step(sched, tier)
    run_step(sched, tier)
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert sched.stats.num_swap_fallbacks == 1 and sched.stats.num_swap_preemptions == 0


def test_a_sequence_aborted_while_loading_frees_its_blocks_when_the_copies_land():
    sched, tier = make(num_blocks=6, slots=8, mode=PreemptionMode.SWAP)
    a, b = make_seq(12, BS), make_seq(12, BS)
    sched.add(a)
    sched.add(b)
    run_step(sched, tier)
    run_step(sched, tier)
    sched.finish(a, FinishReason.STOP)
    sched.schedule()  # b starts loading
    assert b.status is SequenceStatus.LOADING
    sched.finish(b, FinishReason.ABORT)
    assert b.block_table  # the copies still write them
    land_copies(sched, tier)
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 6
    assert tier.num_free_slots == 8


def test_a_swapped_lora_sequence_gives_its_slot_up_and_takes_it_again_to_load():
    """Swapped out, a sequence holds no adapter slot and no proposal (nor
    draft KV); it loads back only once it holds its adapter's slot again,
    waiting while another adapter's sequence uses the only one (never
    evicting it), and an abort while it loads gives the slot back."""
    a_lora = LoRARequest("a", 1, "/adapters/a")
    tier = HostTier(8)
    lora_slots = LoRASlots(1)
    sched = Scheduler(BlockManager(6, BS, host_tier=tier), 8, 64, 256,
                      preemption_mode=PreemptionMode.SWAP, lora_slots=lora_slots)  # fmt: skip
    a, b = make_seq(12, BS), make_seq(12, BS)
    a.lora_request = b.lora_request = a_lora
    sched.add(a)
    sched.add(b)
    run_step(sched, tier)
    assert lora_slots.users(1) == 2
    b.spec_token_ids, b.num_draft_computed_tokens = [5, 6], 12  # a proposal, its draft KV
    run_step(sched, tier)  # a's 13th token needs a block: b swaps out
    assert b.status is SequenceStatus.SWAPPED and lora_slots.users(1) == 1
    assert b.spec_token_ids == [] and b.num_draft_computed_tokens == 0
    sched.finish(a, FinishReason.STOP)
    assert lora_slots.acquire(3) == 0  # adapter 3's sequence takes the idle slot
    _, copies = run_step(sched, tier)
    assert b.status is SequenceStatus.SWAPPED and not copies.to_device  # waits for a slot
    assert lora_slots.resident == {3: 0} and lora_slots.users(3) == 1
    lora_slots.release(3)
    sched.schedule()
    assert b.status is SequenceStatus.LOADING and lora_slots.resident == {1: 0}
    assert lora_slots.users(1) == 1
    sched.finish(b, FinishReason.ABORT)
    assert lora_slots.users(1) == 0
    land_copies(sched, tier)
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 6
    assert tier.num_free_slots == 8


def test_the_tier_records_hits_when_their_copy_lands_and_removals_when_evicted():
    tier = HostTier(2, record_events=True)
    tier.spill(h(1), h(0), (1,) * BS, 0)
    assert tier.take_events() == ([], [])  # still landing: no hit yet
    tier.landed(tier.take_copies())
    assert tier.take_events() == ([h(1)], [])
    spill_chain(tier, [2, 3])  # 1 is evicted for 3
    assert tier.take_events() == ([h(2), h(3)], [h(1)])
    assert sorted(tier.cached_hashes()) == [h(2), h(3)]
    slots = tier.swap_out([4])  # a swap-out carries no hash: no event
    tier.landed(tier.take_copies())
    assert tier.take_events() == ([], [h(2)])
    tier.release(slots)
    tier.reset()
    assert tier.take_events() == ([], [h(3)])
    tier.check_invariants()


def test_block_manager_events_carry_both_tiers_and_a_load_makes_a_device_hit_again():
    sched, tier = make(num_blocks=4, slots=8)
    bm = sched.block_manager
    bm.enable_events()
    first = make_seq(list(range(100, 113)), BS)  # 3 full blocks + 1 token
    sched.add(first)
    run_step(sched, tier)
    finish_all(sched)
    events = bm.take_events()
    assert len(events.stored) == 3 and not events.host_stored
    chain = events.stored
    sched.add(make_seq(13, BS))  # evicts first's cached blocks: they spill
    run_step(sched, tier)
    finish_all(sched)
    events = bm.take_events()
    assert set(chain) <= set(events.removed) and set(events.host_stored) == set(chain)
    snapshot = bm.cached_snapshot()
    assert set(snapshot.host_stored) == set(chain) and not bm.take_events().stored
    sched.add(again := make_seq(list(range(100, 113)) + [7, 8, 9], BS))
    run_step(sched, tier)
    assert again.num_cached_tokens == 12
    events = bm.take_events()
    # Loaded back: a device hit again; the tier keeps its copies.
    assert set(chain) <= set(events.stored) and not events.host_removed
    finish_all(sched)


def test_a_reservation_counts_device_then_host_hits_and_queues_their_copies():
    """Decode node: a reservation starts from the pool's hit and continues in
    the tier (copies queued to the blocks right after the pool's hit, no
    LOADING); its own allocation's spills never evict those hits; refused for
    want of blocks, it leaves both tiers as they were."""
    sched, tier = make(num_blocks=6, slots=8)
    bm = sched.block_manager
    prompt = list(range(100, 121))  # 5 full blocks + 1 token
    first = make_seq(prompt[:13], BS)  # its 3 full blocks get cached, then evicted
    sched.add(first)
    run_step(sched, tier)
    finish_all(sched)
    sched.add(make_seq(21, BS))  # takes all 6 blocks: first's 3 spill
    run_step(sched, tier)
    finish_all(sched)
    assert tier.num_cached_slots == 3 and bm.num_cached_blocks == 5
    too_big = make_seq(prompt + list(range(500, 520)), BS)  # 10 blocks: never fits
    assert not sched.reserve(too_big)
    assert not tier.take_copies() and not too_big.block_table
    assert tier.num_free_slots == 8 and bm.num_free_blocks == 6
    res = make_seq(prompt, BS)
    assert sched.reserve(res)
    assert res.status is SequenceStatus.RESERVED and not sched.take_new_loads()
    assert res.num_computed_tokens == res.num_cached_tokens == 3 * BS
    copies = tier.take_copies()
    # Its 6 blocks evicted the other prompt's 5 cached ones (they spill), never
    # the 3 hit slots it holds: those load into the table's first 3 blocks.
    assert len(copies.to_host) == 5
    assert [d for _, d in copies.to_device] == res.block_table[:3]
    assert tier.stats.hit_blocks == 3 and sched.stats.prefix_cache_hit_tokens == 0
    tier.copies_issued(copies)
    tier.landed(copies)
    sched.finish(res, FinishReason.ABORT)
    bm.check_invariants()
    tier.check_invariants()
    assert bm.num_free_blocks == 6 and tier.num_free_slots == 8
