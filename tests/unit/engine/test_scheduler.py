"""Scheduler: continuous batching, chunked prefill, decode priority, limits, preemption, abort."""

from __future__ import annotations

import logging

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, SequenceStatus
from tests.unit.engine.helpers import make_seq

BS = 4


def make(num_blocks=64, max_seqs=8, budget=64, max_len=256, chunked=True, caching=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(bm, max_seqs, budget, max_len, enable_chunked_prefill=chunked)


def step(sched: Scheduler, token: int = 1):
    """Schedule, pretend the model ran, append `token` for sequences that sampled."""
    batch = sched.schedule()
    sampled = [
        token if s.num_computed_tokens + n == s.num_tokens else None
        for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
    ]
    sched.update(batch, sampled)
    sched.block_manager.check_invariants()
    return batch


def scheduled(batch) -> dict[int, int]:
    return {s.seq_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}


def test_continuous_batching_admits_new_work_between_steps():
    sched = make()
    a = make_seq(8, BS)
    sched.add(a)
    assert scheduled(step(sched)) == {a.seq_id: 8}
    b = make_seq(5, BS)
    sched.add(b)
    batch = step(sched)
    assert scheduled(batch) == {a.seq_id: 1, b.seq_id: 5}
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    sched = make(budget=32)
    seq = make_seq(100, BS)
    sched.add(seq)
    chunks = [scheduled(step(sched))[seq.seq_id] for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert seq.num_output_tokens == 1  # only the last chunk samples


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make(budget=16)
    decoders = [make_seq(4, BS) for _ in range(3)]
    for d in decoders:
        sched.add(d)
    step(sched)  # prefill the three short prompts (12 tokens)
    long = make_seq(200, BS)
    sched.add(long)
    for _ in range(10):
        batch = scheduled(step(sched))
        assert all(batch[d.seq_id] == 1 for d in decoders)  # every step, every decode
        assert batch[long.seq_id] == 16 - 3  # the prefill gets what is left


def test_without_chunking_a_prompt_waits_for_budget():
    sched = make(budget=32, chunked=False)
    a, b = make_seq(20, BS), make_seq(20, BS)
    sched.add(a)
    sched.add(b)
    assert scheduled(step(sched)) == {a.seq_id: 20}
    assert scheduled(step(sched)) == {a.seq_id: 1, b.seq_id: 20}


def test_max_num_seqs_bounds_the_running_set():
    sched = make(max_seqs=2)
    seqs = [make_seq(4, BS) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    sched.finish(seqs[0], FinishReason.STOP)
    step(sched)
    assert len(sched.running) == 2 and seqs[2].status is SequenceStatus.RUNNING


def test_finish_and_abort_free_blocks_at_once():
    sched = make(num_blocks=16)
    a, b, c = make_seq(8, BS), make_seq(8, BS), make_seq(8, BS)
    for s in (a, b):
        sched.add(s)
    step(sched)
    sched.add(c)  # waiting, holds nothing yet
    used = sched.block_manager.num_used_blocks
    sched.finish(a, FinishReason.LENGTH)
    # 8 computed tokens in 2 blocks (the sampled 9th gets its slot next step)
    assert sched.block_manager.num_used_blocks == used - 2
    assert a.finish_reason is FinishReason.LENGTH and a not in sched.running
    sched.abort([b, c])
    assert sched.block_manager.num_free_blocks == 16
    assert not sched.has_unfinished()
    assert b.finish_reason is FinishReason.ABORT and c.finish_reason is FinishReason.ABORT


def test_preemption_by_recompute_when_blocks_run_out(caplog):
    # 6 blocks of 4 tokens; two sequences of 8 tokens each need 3 blocks once they decode.
    sched = make(num_blocks=6, caching=False)
    a, b = make_seq(8, BS), make_seq(8, BS)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 2 + 2 blocks, 9 tokens each
    with caplog.at_level(logging.WARNING):
        step(sched)  # both need a third block: 2 free -> fine
        for _ in range(4):
            batch = step(sched)
            if batch.preempted:
                break
    assert batch.preempted == [b]  # the most recently admitted goes
    assert sched.stats.num_preemptions == 1
    assert "preempted" in caplog.text
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and sched.waiting[0] is b
    assert b.num_output_tokens > 0  # generated tokens are kept and recomputed
    # No admission in a step that preempted; b returns once a finishes.
    sched.finish(a, FinishReason.STOP)
    batch = step(sched)
    assert scheduled(batch) == {b.seq_id: b.num_tokens - 1}


def test_a_committed_remote_prefill_preempted_before_its_first_step_keeps_its_kv_cached():
    """A decode node's reservation took the last free blocks; committed, it is
    the most recent, so the first victim when an older sequence needs a block.
    The prefill node's KV that landed in it must stay in the prefix cache for
    its recompute (commit leaves registering it to the first step)."""
    sched = make(num_blocks=8)
    a = make_seq(8, BS)
    sched.add(a)
    step(sched)  # a: 2 blocks, 9 tokens
    remote = make_seq(23, BS)  # 6 blocks: every free one
    assert sched.reserve(remote)
    sched.commit(remote)
    remote.token_ids.append(5)  # the prefill node's first token
    batch = step(sched)  # a needs its third block
    assert batch.preempted == [remote]
    assert len(sched.block_manager.find_cached_prefix(remote)) == 5  # of its 24 tokens' 6 blocks


def test_a_sequence_can_preempt_itself_and_resume():
    sched = make(num_blocks=3, caching=False, max_len=12)
    a = make_seq(7, BS)
    sched.add(a)
    for _ in range(5):
        step(sched)
    assert a.num_tokens == 12 and sched.stats.num_preemptions == 0


def test_prefix_hit_is_reported_once_at_first_admission():
    sched = make()
    a = make_seq(list(range(20)), BS)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(16)) + [7, 7], BS)
    sched.add(b)
    batch = scheduled(step(sched))
    assert batch[b.seq_id] == 2  # only the two uncached tokens are computed
    assert b.num_cached_tokens == 16
    assert sched.stats.prefix_cache_hit_tokens == 16
    assert sched.stats.prefix_cache_queried_tokens == 20 + 18


def test_prompts_admitted_together_share_the_blocks_the_first_computes():
    sched = make()
    a = make_seq(list(range(10)), BS)
    b = make_seq(list(range(8)) + [7, 7, 7], BS)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    # b hits a's two full blocks in the step that computes them: 3 tokens, not 11.
    assert scheduled(batch) == {a.seq_id: 10, b.seq_id: 3}
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert sched.stats.prefix_cache_hit_tokens == 8
    sched.update(batch, [1, 1])
    sched.block_manager.check_invariants()


def test_a_prompt_chunk_offers_only_the_blocks_it_completes():
    sched = make(budget=8)
    a = make_seq(list(range(12)), BS)
    sched.add(a)
    batch = sched.schedule()
    assert scheduled(batch) == {a.seq_id: 8}
    assert a.num_cached_blocks == 2  # the chunk's two blocks, not the prompt's third
    sched.update(batch, [None])
    b = make_seq(list(range(12)) + [5, 5, 5], BS)
    sched.add(b)
    # a's last chunk completes its third block; b, admitted after it in the same
    # step, hits all three and computes its own three tokens.
    assert scheduled(step(sched)) == {a.seq_id: 4, b.seq_id: 3}
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]


def test_a_decode_row_joins_the_cache_only_once_its_token_is_read():
    """Async scheduling: the next step is planned while the last sampled token is
    still a placeholder; the block it completes must not be hashed with it."""
    sched = make()
    a = make_seq(list(range(7)), BS)
    sched.add(a)
    first = sched.schedule()
    ((_, pos),) = [(i, s.token_ids.index(-1)) for i, s in sched.advance(first)]
    second = sched.schedule()  # a's decode row computes position 7, a placeholder
    assert scheduled(second) == {a.seq_id: 1}
    assert a.num_cached_blocks == 1  # block 1 ends with the placeholder: not yet
    a.token_ids[pos] = 42  # the first step is read
    sched.advance(second)
    assert a.num_cached_blocks == 2
    c = make_seq([0, 1, 2, 3, 4, 5, 6, 42, 9], BS)
    sched.add(c)
    assert scheduled(sched.schedule())[c.seq_id] == 1  # both blocks hit, with the real token


def test_no_progress_is_impossible_when_pool_fits_max_len():
    # A pool exactly the size of one max-length sequence serves many sequences in turn.
    sched = make(num_blocks=4, max_seqs=4, caching=False, max_len=16)
    seqs = [make_seq(6, BS) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
        for s in list(sched.running):
            if s.num_tokens >= 12:
                sched.finish(s, FinishReason.LENGTH)
    assert not sched.has_unfinished()
    assert all(s.num_tokens >= 12 for s in seqs)


def test_prompt_logprobs_requests_compute_the_whole_prompt():
    from engine.sampling_params import SamplingParams

    sched = make()
    a = make_seq(list(range(20)), BS)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(20)), BS, params=SamplingParams(prompt_logprobs=1))
    sched.add(b)
    assert scheduled(step(sched))[b.seq_id] == 20  # no cache read: every position has logits
    assert b.num_cached_tokens == 0


def make_sliding(window: int, num_blocks=64, budget=64, caching=True) -> Scheduler:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(bm, 8, budget, 256, sliding_window=window)


def test_blocks_before_every_layers_window_are_freed_as_a_sequence_runs():
    """Window 6, blocks of 4: once the next query is at position p, keys before
    p - 5 are never read again, so the blocks wholly before that go back."""
    from engine.block_manager import NO_BLOCK

    sched = make_sliding(window=6)
    bm = sched.block_manager
    seq = make_seq(21, BS, params=SamplingParams(max_tokens=100))
    sched.add(seq)
    step(sched)  # 21 tokens computed: the next query (21) sees 16.. -> blocks 0-3 go
    assert seq.block_table[:4] == [NO_BLOCK] * 4 and NO_BLOCK not in seq.block_table[4:]
    assert seq.num_window_freed_blocks == 4 and sched.stats.num_window_freed_blocks == 4
    assert bm.num_used_blocks == 2  # tokens 16..21 (the 22nd's slot comes next step)
    for _ in range(8):
        step(sched)
    # 29 computed: the next query sees 24.. -> 6 blocks freed; 2 held.
    assert seq.num_window_freed_blocks == 6 and bm.num_used_blocks == 2
    # What was freed stays in the prefix cache for a later request with this prefix.
    assert bm.num_cached_free_blocks == 6
    sched.finish(seq, FinishReason.LENGTH)
    assert bm.num_free_blocks == bm.num_blocks and seq.block_table == []
    bm.check_invariants()


def test_window_freeing_lets_long_sequences_share_a_small_pool():
    """Three 40-token sequences in 12 blocks of 4 (30 tokens' worth each without
    freeing): with a window of 6 each holds at most 3 blocks, nobody is preempted."""
    sched = make_sliding(window=6, num_blocks=12, budget=16, caching=False)
    seqs = [make_seq(10, BS, params=SamplingParams(max_tokens=100)) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    for _ in range(40):
        step(sched)
    assert sched.stats.num_preemptions == 0
    assert all(s.num_tokens >= 40 for s in seqs), [s.num_tokens for s in seqs]
    assert max(len([b for b in s.block_table if b >= 0]) for s in seqs) <= 3


def test_held_sequences_and_preemption_with_window_freeing():
    """A prefill node's held sequence keeps every block (the transfer reads them);
    a preempted one releases what it still holds and recomputes from scratch."""
    sched = make_sliding(window=6, num_blocks=64)
    held, other = make_seq(21, BS), make_seq(21, BS)
    held.hold_kv = True
    sched.add(held)
    sched.add(other)
    step(sched)
    assert held.num_window_freed_blocks == 0 and -1 not in held.block_table
    assert other.num_window_freed_blocks == 4
    sched._preempt(other)
    assert other.block_table == [] and other.num_window_freed_blocks == 0
    sched.block_manager.check_invariants()
    step(sched)  # recomputed whole, and freed again
    assert other.num_window_freed_blocks == 4


def test_a_queue_behind_reservations_waits_for_room_and_changes_mark_its_end():
    """Reserved blocks fill the pool and nothing runs: the waiting sequence
    waits for room (``waits_for_room``), and what can end the wait (a commit,
    an abort) moves ``num_changes``; a step does not."""
    sched = make(num_blocks=8)
    remote, local = make_seq(24, BS), make_seq(12, BS)  # 6 blocks, 3 blocks
    assert not sched.waits_for_room()
    assert sched.reserve(remote)
    sched.add(local)
    assert len(step(sched)) == 0 and list(sched.waiting) == [local]
    assert sched.waits_for_room()
    changes = sched.num_changes
    step(sched)
    assert sched.num_changes == changes  # nothing changed: the wait goes on
    sched.finish(remote, FinishReason.ABORT)  # its lease ran out
    assert sched.num_changes > changes and not sched.waits_for_room()
    assert scheduled(step(sched)) == {local.seq_id: 12}
    assert not sched.waits_for_room()  # it runs


def test_a_waiting_queue_with_no_reservation_never_waits_for_room():
    """Blocks short with nothing reserved or held: not a wait for room (the
    engine reports that state as its failure)."""
    sched = make(num_blocks=4)
    leak = make_seq(12, BS, hashed=False)
    assert sched.block_manager.allocate_slots(leak, 12)  # 3 blocks nobody frees
    sched.add(make_seq(8, BS))
    assert len(step(sched)) == 0
    assert not sched.waits_for_room()
