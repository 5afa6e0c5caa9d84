"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Pure Python, no torch. Each step it hands the model runner a list of
(sequence, number of new tokens) pairs under two budgets: ``max_num_batched_tokens``
tokens and ``max_num_seqs`` running sequences.

Order within a step:
1. Running sequences that are decoding (one token each; those verifying a
   speculative proposal, its tokens too, after the others). Nothing else is
   scheduled before them, so a long prefill can never starve decodes.
2. Running sequences part-way through a chunked prefill.
3. Waiting sequences, first come first served (preempted ones go to the front),
   each starting from its verified prefix-cache hit. None are admitted in a
   step that had to preempt: memory is short, admitting more would thrash.

A prompt's blocks join the prefix cache when they are scheduled, not when the
step has run: a prompt admitted later in the same step hits the blocks an
earlier one computes in it (every attention backend writes a layer's new keys
and values for the whole batch before any row attends), so prompts that share
a system prompt and arrive together compute it once. Any later reader runs
after the step on the device. Decode rows wait for the step: under async
scheduling their last token is still a placeholder when the next step is
planned.

When the KV pool cannot hold a running sequence's next tokens, the most
recently admitted sequence not yet scheduled this step is preempted: its blocks
are freed (cached ones stay in the prefix cache, so the recompute mostly hits)
and it goes back to the front of the queue with ``num_computed_tokens = 0``.

With a host tier (engine/host_tier.py) two more paths exist, both through
LOADING: the sequence holds device blocks that copies from the host fill, is
not scheduled, and joins the running batch once the engine reports the copies
landed (``loads_done``), so only it waits for them.
- A waiting prompt whose prefix continues past its device-cache hit in the
  host tier claims blocks for those hits and loads them.
- ``preemption_mode="swap"``: a victim's blocks are copied to the host tier
  (SWAPPED); swapped sequences resume, before any waiting one is admitted,
  by loading them back. A victim whose blocks the tier cannot take is
  preempted by recompute instead (``num_swap_fallbacks``).
A decode node's reservation (``reserve``) takes host-tier hits after its
device-cache hit too, but stays RESERVED: the engine waits for their copies
before the reservation goes to the prefill node, which sends only the rest.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import PreemptionMode
from engine.lora.slots import LoRASlots
from engine.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences this step took from the waiting queue (also in ``seqs``).
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def sampling_rows(self) -> list[int]:
        """The rows that sample: those whose last uncomputed token is in the step
        (asked before ``Scheduler.advance`` counts the step computed)."""
        return [
            i
            for i, (s, n) in enumerate(zip(self.seqs, self.num_new_tokens, strict=True))
            if s.num_computed_tokens + n - len(s.spec_token_ids) == len(s.token_ids)
        ]

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    # Blocks released before a sliding window (models whose layers all slide).
    num_window_freed_blocks: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_steps: int = 0
    # Preemptions by swap, and those that fell back to recompute (the host
    # tier could not take the victim's blocks).
    num_swap_preemptions: int = 0
    num_swap_fallbacks: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        sliding_window: int | None = None,
        preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE,
        lora_slots: LoRASlots | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.host_tier = block_manager.host_tier
        if preemption_mode is PreemptionMode.SWAP and self.host_tier is None:
            raise ValueError('preemption_mode="swap" needs a host tier (swap_space > 0)')
        self.preemption_mode = preemption_mode
        # With LoRA: a sequence naming an adapter holds one of its device slots
        # while it runs (or is reserved, or loads); without a free one it waits.
        self.lora_slots = lora_slots
        # Set when every layer of the model slides: a running sequence's blocks
        # before its window are freed as it advances (BlockManager.free_blocks_before).
        self.sliding_window = sliding_window
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Decode node: sequences whose prompt KV a prefill node is computing.
        self.reserved: dict[int, Sequence] = {}
        # Prefill node: finished sequences whose blocks are held for a transfer.
        self.held: dict[str, Sequence] = {}
        # Host tier: sequences whose blocks copies from the host fill (kept
        # until the copies land, even if finished meanwhile: the copies write
        # their blocks), those started this step, and swapped-out ones.
        self.loading: dict[int, Sequence] = {}
        self._new_loads: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.stats = SchedulerStats()
        # Moves whenever a sequence joins, leaves or changes set from outside
        # a step (add, reserve, commit, finish, release, loads landing): an
        # engine waiting for room that reservations hold (``waits_for_room``)
        # has nothing new to schedule until it does.
        self.num_changes = 0

    # ------------------------------------------------------------ membership
    def add(self, seq: Sequence) -> None:
        self.num_changes += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading) + len(self.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.swapped)

    def waits_for_room(self) -> bool:
        """Whether a step that scheduled nothing (no preemption, no load, no
        grammar compiling) did so because reservations (decode node) or blocks
        held for a transfer (prefill node) hold the room -- KV blocks, sequence
        slots, adapter slots -- that the swapped or waiting sequences need.
        Nothing runs or loads then, so once they leave the whole pool is free,
        and every sequence fits an empty pool (the engine refuses a pool
        smaller than max_model_len, and a prompt not shorter than it). They
        leave through the node's commands (a commit, an abort when a lease
        ends, a release), each a change (``num_changes``)."""
        return bool(
            (self.reserved or self.held)
            and (self.waiting or self.swapped)
            and not (self.running or self.loading)
        )

    def finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """Mark a sequence finished and free its blocks at once (or hold them, for a
        prefill node's transfer, unless it was aborted)."""
        self.num_changes += 1
        if seq.is_finished:
            if reason is FinishReason.ABORT:
                self.release_held(seq)
            return
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.RESERVED, SequenceStatus.LOADING):
            self._release_lora(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            # A committed remote prefill that ends at its first token ran no
            # step: its prompt's blocks join the prefix cache here (``commit``).
            self.block_manager.cache_full_blocks(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RESERVED:
            del self.reserved[seq.seq_id]
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.host_tier.release(seq.swapped_slots)
            seq.swapped_slots = []
        elif seq.status is SequenceStatus.LOADING:
            # Its blocks are freed once its copies land (``loads_done``).
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            return
        seq.status = SequenceStatus.FINISHED
        seq.spec_token_ids = []
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.hold_kv and reason is not FinishReason.ABORT:
            self.held[seq.request_id] = seq
        else:
            self.block_manager.free(seq)

    def _acquire_lora(self, seq: Sequence) -> bool:
        """A device slot for the sequence's adapter (True without one)."""
        if seq.lora_request is None or self.lora_slots is None:
            return True
        return self.lora_slots.acquire(seq.lora_request.lora_int_id) is not None

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_request is not None and self.lora_slots is not None:
            self.lora_slots.release(seq.lora_request.lora_int_id)

    def release_held(self, seq: Sequence) -> None:
        if self.held.pop(seq.request_id, None) is not None:
            self.num_changes += 1
            self.block_manager.free(seq)

    @property
    def num_free_slots(self) -> int:
        """Sequence slots neither running, reserved nor loading (what a new request may take)."""
        return self.max_num_seqs - len(self.running) - len(self.reserved) - len(self.loading)

    # ------------------------------------------------------ remote prefill
    def reserve(self, seq: Sequence) -> bool:
        """Claim blocks for the whole prompt without scheduling it (decode node).

        Starts from this node's own verified prefix-cache hit, in the device
        pool and then in the host tier (whose blocks are copied in: the engine
        issues the copies before the KV lands), so only the rest has to
        arrive; False (nothing changed) when blocks or sequence slots are short.
        """
        if self.num_free_slots <= 0 or not self._acquire_lora(seq):
            return False
        bm = self.block_manager
        prefix = bm.find_cached_prefix(seq)
        hits = self._host_hits(seq, len(prefix))
        num_prefix_tokens = len(prefix) * bm.block_size
        if not self._claim(seq, prefix, hits, seq.num_tokens - num_prefix_tokens):
            self._release_lora(seq)
            return False
        seq.num_cached_tokens = seq.num_computed_tokens
        self.stats.prefix_cache_queried_tokens += seq.num_tokens
        self.stats.prefix_cache_hit_tokens += num_prefix_tokens
        seq.status = SequenceStatus.RESERVED
        self.reserved[seq.seq_id] = seq
        self.num_changes += 1
        return True

    def commit(self, seq: Sequence) -> None:
        """The reserved prompt's KV has landed: the sequence joins the running batch.

        Its full blocks join the prefix cache at its first step's ``advance``
        (after that step's launch), not here: registering a long prompt's
        blocks is host work on the request's time to first token
        (docs/lab/2026-11-27-inline-commands-decode-node.md)."""
        del self.reserved[seq.seq_id]
        self.num_changes += 1
        seq.num_computed_tokens = seq.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT)

    # ------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        # Once per step over every running sequence: attributes read directly,
        # not through Sequence's properties (this loop is per-step host work).
        # Speculating rows (several query tokens each) follow the plain decodes:
        # the attention backends serve the leading one-token rows with their
        # decode kernels, everything from the first longer row on as a prefill.
        decoding, verifying, prefilling = [], [], []
        for s in self.running:
            if len(s.token_ids) - s.num_computed_tokens != 1:
                prefilling.append(s)
            else:
                (verifying if s.spec_token_ids else decoding).append(s)
        if verifying:
            decoding.extend(verifying)
        if prefilling:
            decoding.extend(prefilling)
        running = SequenceStatus.RUNNING
        max_model_len = self.max_model_len
        bs = self.block_manager.block_size
        seqs, num_new_tokens = batch.seqs, batch.num_new_tokens
        for seq in decoding:
            if budget == 0:
                break
            if seq.status is not running or seq.awaiting_grammar:
                continue  # preempted earlier in this step, or its grammar compiles
            num_tokens = len(seq.token_ids)
            # Done by length once its unread token is read (async scheduling):
            # running it once more would only compute a token to drop (and, on
            # a prefill node, claim a block the transfer does not want). Never
            # true without async scheduling: such a sequence has finished.
            limit = seq.params.max_tokens
            if (
                limit is not None and num_tokens - seq.num_prompt_tokens >= limit
            ) or num_tokens >= max_model_len:
                continue
            computed = seq.num_computed_tokens
            num_new = min(num_tokens - computed, budget)
            if seq.spec_token_ids:  # its last token, then the proposal (what fits)
                num_new = min(1 + len(seq.spec_token_ids), budget)
                del seq.spec_token_ids[num_new - 1 :]
            # Most steps need no new block: skip the allocator then.
            if (computed + num_new + bs - 1) // bs > len(
                seq.block_table
            ) and not self._allocate_or_preempt(seq, num_new, scheduled_ids, batch):
                continue
            seqs.append(seq)
            num_new_tokens.append(num_new)
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            if num_tokens - computed > 1:  # a prompt chunk (a decode row's token may be unread)
                self.block_manager.cache_full_blocks(seq, computed + num_new)

        if not batch.preempted and self._resume_swapped():
            budget = self._admit_waiting(batch, budget)
        self.stats.num_steps += 1
        return batch

    def _allocate_or_preempt(
        self, seq: Sequence, num_new: int, scheduled_ids: set[int], batch: ScheduledBatch
    ) -> bool:
        while not self.block_manager.allocate_slots(seq, num_new):
            victim = next(
                (s for s in reversed(self.running) if s.seq_id not in scheduled_ids), None
            )
            if victim is None:  # pragma: no cover - seq itself is always a candidate
                raise RuntimeError("no sequence left to preempt")
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_lora(seq)
        # What it computed stays in the prefix cache for its recompute: a
        # committed remote prefill preempted before its first step (the most
        # recent, so the first victim) has registered nothing yet (``commit``).
        self.block_manager.cache_full_blocks(seq)
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        # Its proposal is made again once it runs. Its draft KV is dropped
        # either way, not swapped: the host tier holds the target's KV only,
        # and the draft catches up over the whole sequence at its next
        # proposal, as it does for any new sequence or prefix hit.
        seq.spec_token_ids = []
        seq.num_draft_computed_tokens = 0
        if self.preemption_mode is PreemptionMode.SWAP and self._swap_out(seq):
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        logger.warning(
            "preempted request %s (seq %d, %d tokens) by recompute: KV cache is full "
            "(%d preemptions so far); consider a larger KV cache or a lower max_num_seqs",
            seq.request_id,
            seq.seq_id,
            seq.num_tokens,
            self.stats.num_preemptions,
        )

    def _swap_out(self, seq: Sequence) -> bool:
        """Park the victim's computed blocks in the host tier (SWAPPED); False,
        nothing changed, where it has none or the tier cannot take them (nor
        blocks a sliding window freed: its table has holes)."""
        bm = self.block_manager
        num_blocks = bm.blocks_needed(seq.num_computed_tokens)
        if num_blocks == 0:
            return False
        slots = None
        if not seq.num_window_freed_blocks and len(seq.block_table) >= num_blocks:
            slots = self.host_tier.swap_out(seq.block_table[:num_blocks])
        if slots is None:
            self.stats.num_swap_fallbacks += 1
            return False
        bm.free(seq)  # the copies run before any later write to these blocks
        seq.swapped_slots = slots
        seq.status = SequenceStatus.SWAPPED
        self.swapped.appendleft(seq)
        self.stats.num_swap_preemptions += 1
        logger.warning(
            "preempted request %s (seq %d, %d tokens) by swap: KV cache is full "
            "(%d preemptions so far); consider a larger KV cache or a lower max_num_seqs",
            seq.request_id,
            seq.seq_id,
            seq.num_tokens,
            self.stats.num_preemptions,
        )
        return True

    def _resume_swapped(self) -> bool:
        """Start loading swapped sequences back, the last victim first (victims
        are taken newest request first, so that is the oldest request, as
        with recompute's queue front); False while one must wait (its
        swap-out still copying, or too few blocks, sequence slots or, with
        LoRA, no device slot for its adapter): no waiting sequence is
        admitted before it. A swapped sequence holds no adapter slot (others
        may need it); it takes one again here, as admission does, and keeps
        it while it loads."""
        bm = self.block_manager
        while self.swapped:
            seq = self.swapped[0]
            if self.num_free_slots <= 0 or not self.host_tier.all_landed(seq.swapped_slots):
                return False
            if not self._acquire_lora(seq):
                return False
            if not bm.allocate_slots(seq, 0):  # blocks for its computed tokens
                self._release_lora(seq)
                return False
            self.swapped.popleft()
            # The sequence's references to its slots pass to the load.
            self.host_tier.load(seq.swapped_slots, seq.block_table)
            seq.swapped_slots = []
            self._begin_load(seq)
        return True

    def _host_hits(self, seq: Sequence, start: int) -> list[int]:
        """Host-tier slots continuing a waiting prompt's device-cache hit of
        ``start`` blocks (``find_cached_prefix`` hashed its blocks)."""
        bm = self.block_manager
        if self.host_tier is None or not bm.enable_prefix_caching or seq.hasher is None:
            return []
        bs = bm.block_size
        limit = min((seq.num_tokens - 1) // bs, len(seq.block_hashes))
        return self.host_tier.find_prefix(seq.block_hashes, seq.token_ids, bs, start, limit)

    def _start_load(self, seq: Sequence, prefix: list[int], hits: list[int]) -> bool:
        """Claim the device-cache hit and blocks for the host-tier hits, and queue
        their copies (LOADING); False, nothing changed, when blocks are short."""
        bs = self.block_manager.block_size
        if not self._claim(seq, prefix, hits, len(hits) * bs):
            return False
        if seq.num_cached_tokens < 0:  # first admission: report the hit once
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.stats.prefix_cache_queried_tokens += seq.num_tokens
            self.stats.prefix_cache_hit_tokens += len(prefix) * bs
        self._begin_load(seq)
        return True

    def _claim(self, seq: Sequence, prefix: list[int], hits: list[int], num_new: int) -> bool:
        """Claim the device-cache hit ``prefix`` and blocks for ``num_new`` more
        tokens, the host-tier hits' copies filling the first of them (queued:
        the engine issues them before anything reads or writes those blocks);
        ``num_computed_tokens`` moves past both hits. False, nothing changed,
        when blocks are short."""
        bm, tier = self.block_manager, self.host_tier
        if hits:
            tier.hold(hits)  # a spill this allocation causes must not evict them
        if not bm.allocate_slots(seq, num_new, prefix):
            if hits:
                tier.release(hits)
            return False
        if hits:
            first = len(prefix)
            tier.load(hits, seq.block_table[first : first + len(hits)])
            tier.stats.hit_blocks += len(hits)
            seq.num_computed_tokens += len(hits) * bm.block_size
        return True

    def _begin_load(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.LOADING
        self.loading[seq.seq_id] = seq
        self._new_loads.append(seq)

    def take_new_loads(self) -> list[Sequence]:
        """Sequences that began loading since the last take (their copies are
        the host tier's ``take_copies``)."""
        loads, self._new_loads = self._new_loads, []
        return loads

    def loads_done(self, seqs: list[Sequence]) -> None:
        """Their copies from the host tier have landed: they join the running
        batch, and the loaded blocks the device prefix cache; one finished
        meanwhile frees its blocks now."""
        self.num_changes += 1
        for seq in seqs:
            del self.loading[seq.seq_id]
            if seq.status is SequenceStatus.FINISHED:
                self.block_manager.free(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.block_manager.cache_full_blocks(seq)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        bm = self.block_manager
        waiting = self.waiting
        # Sequences whose grammar still compiles, or whose LoRA adapter finds
        # no free device slot, keep their place in the queue; those behind
        # them are admitted meanwhile, except other adapters' once one waits
        # for a slot: admitting them would keep the slots busy and starve it.
        passed: list[Sequence] = []
        slot_wait = False
        while waiting and budget > 0 and self.num_free_slots > 0:
            seq = waiting[0]
            if seq.awaiting_grammar:
                passed.append(waiting.popleft())
                continue
            if seq.lora_request is not None and (slot_wait or not self._acquire_lora(seq)):
                slot_wait = True
                passed.append(waiting.popleft())
                continue
            # Prompt logprobs need logits at every prompt position, so such a
            # request computes its whole prompt (its blocks still get cached).
            use_cache = seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None
            prefix = bm.find_cached_prefix(seq) if use_cache else []
            hits = self._host_hits(seq, len(prefix)) if use_cache else []
            if hits:
                if not self._start_load(seq, prefix, hits):
                    self._release_lora(seq)
                    break
                waiting.popleft()
                continue
            num_prefix_tokens = len(prefix) * bm.block_size
            num_new = seq.num_uncomputed_tokens - num_prefix_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    self._release_lora(seq)
                    break
                num_new = budget
            if not bm.allocate_slots(seq, num_new, prefix):
                self._release_lora(seq)
                break
            waiting.popleft()
            if seq.num_cached_tokens < 0:  # first admission: report the hit once
                seq.num_cached_tokens = min(num_prefix_tokens, seq.num_prompt_tokens)
                self.stats.prefix_cache_queried_tokens += seq.num_tokens
                self.stats.prefix_cache_hit_tokens += num_prefix_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            batch.admitted.append(seq)
            budget -= num_new
            # Prompts admitted after it in this step may hit these blocks.
            bm.cache_full_blocks(seq, seq.num_computed_tokens + num_new)
        waiting.extendleft(reversed(passed))
        return budget

    # --------------------------------------------------------------- update
    def advance(self, batch: ScheduledBatch) -> list[tuple[int, Sequence]]:
        """After a step is launched: count its tokens computed, register newly full
        blocks, and append ``PLACEHOLDER`` to each sequence that samples in it.

        Returns (batch row, sequence) for each placeholder; the engine fills them
        when it reads the step's samples. Sequences that finished meanwhile (an
        abort, or a stop found one step late under async scheduling) are skipped:
        the token this step computes for them is dropped.
        """
        appended: list[tuple[int, Sequence]] = []
        bm = self.block_manager
        bs = bm.block_size
        caching = bm.enable_prefix_caching
        window = self.sliding_window
        finished = SequenceStatus.FINISHED
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.status is finished:
                continue
            # A proposal's tokens count computed only once accepted (its KV stays
            # past num_computed_tokens until then; speculator.py).
            computed = seq.num_computed_tokens + num_new - len(seq.spec_token_ids)
            seq.num_computed_tokens = computed
            if caching and computed // bs > seq.num_cached_blocks:
                bm.cache_full_blocks(seq)
            if window is not None:
                self._free_before_window(seq, computed - window + 1)
            token_ids = seq.token_ids
            if computed == len(token_ids):
                token_ids.append(PLACEHOLDER)
                appended.append((i, seq))
        return appended

    def _free_before_window(self, seq: Sequence, first_visible: int) -> None:
        """Free the blocks wholly before the next query's window (the step just
        launched may still read them: the device runs it before any later step
        that could write a reused block). A prefill node's held sequence keeps
        its blocks for the transfer."""
        bs = self.block_manager.block_size
        if seq.hold_kv or first_visible < (seq.num_window_freed_blocks + 1) * bs:
            return
        self.stats.num_window_freed_blocks += self.block_manager.free_blocks_before(
            seq, first_visible
        )

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """``advance`` and fill the placeholders at once (synchronous form)."""
        appended = self.advance(batch)
        for i, seq in appended:
            if sampled[i] is None:
                raise RuntimeError(f"no token sampled for completed sequence {seq.seq_id}")
            seq.token_ids[-1] = sampled[i]
        return [seq for _, seq in appended]
