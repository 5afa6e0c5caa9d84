"""Paged KV block bookkeeping with reference counts and a verified prefix cache.

Pure Python, no torch: the scheduler and the nodes' admission logic use it, and
it unit-tests in milliseconds.

Every block is in exactly one of three places:
- the uncached free queue (no hash; reused first),
- the cached free LRU (hash kept, reference count 0; reused least recently
  freed first, and revived for free if a later request hits its hash),
- in use (reference count >= 1, possibly shared by several sequences through
  prefix caching).
So ``num_free_blocks + num_used_blocks == num_blocks`` always holds;
``check_invariants`` verifies it and the tests call it after every operation.

A hash is a hint (engine/block_hash.py): before a cached block is reused its
tokens and its parent hash are compared with the request's.

A model whose every layer attends within a sliding window never reads a
sequence's keys before its window again: ``free_blocks_before`` releases
those blocks while the sequence runs, and their table entries read
``NO_BLOCK`` (the attention backends load nothing before a window). A freed
block that holds a hash goes to the cached LRU like any other, so a later
request can still hit it; the cache is then not strictly prefix-closed (the
block may be evicted while its successors, still in use, stay cached), which
costs a router at most an overestimated hit: the node verifies hits block by
block from the first and stops at the first missing one.

The set of cached hashes stays prefix-closed: if a block's hash is cached, so
is its parent's. Routers rely on it (common/cluster/state.py finds a node's hit by
binary search). It holds because a hit claims every block before it, freed
blocks enter the LRU tail first (a parent is always at least as recent as its
child), a flush drops only evictable blocks, and a block computed twice (two
requests prefilling the same prefix at once) stays cached as a second holder
of its hash: when the first holder is evicted the hash moves to the second
instead of vanishing under the second's cached children.

With a host tier (``swap_space``) a cached block whose hash leaves this pool
by eviction spills there (engine/host_tier.py queues its copy, which the
engine runs before the block is written again); a flush
(``reset_prefix_cache``) drops both tiers' evictable blocks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.block_hash import ROOT_HASH
from engine.host_tier import HostTier
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

# A block table entry whose block was freed (before a sliding window).
NO_BLOCK = -1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class CacheEvents:
    """Net change of the cache since the last drain (for Redis): a hash stored and
    then evicted is in ``removed`` only, and the other way round in ``stored``.
    ``host_*``: the same for the host tier (a spill that landed is stored there,
    an eviction from the tier removed); a hash may be in both tiers."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    host_stored: list[bytes] = field(default_factory=list)
    host_removed: list[bytes] = field(default_factory=list)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        host_tier: HostTier | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        # Other blocks holding a cached hash's content (computed twice at once).
        self._second_holders: dict[bytes, set[int]] = {}
        self._record_events = record_events
        # hash -> True (stored) / False (removed); the last event wins.
        self._events: dict[bytes, bool] = {}
        self.num_verification_failures = 0
        self.host_tier = host_tier
        if host_tier is not None and record_events:
            host_tier.record_events = True

    # ----------------------------------------------------------------- counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones plus evictable cached ones."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Distinct cached hashes (a hash held by two blocks counts once)."""
        return len(self._hash_to_block)

    def cached_hashes(self) -> list[bytes]:
        """The hashes of every block in the prefix cache (a snapshot for resyncs)."""
        return list(self._hash_to_block)

    def cached_snapshot(self) -> CacheEvents:
        """Every hash both tiers hold now, as ``stored`` events; the events so
        far are dropped (superseded by it)."""
        self.take_events()
        host = self.host_tier.cached_hashes() if self.host_tier is not None else []
        return CacheEvents(stored=self.cached_hashes(), host_stored=host)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------- prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest verified cached prefix of ``seq`` (not yet claimed).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always
        computed so that the step produces logits to sample from.
        """
        if not self.enable_prefix_caching or seq.hasher is None:
            return []
        seq.update_block_hashes()
        bs = self.block_size
        limit = min((seq.num_tokens - 1) // bs, len(seq.block_hashes))
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range(limit):
            block_hash = seq.block_hashes[i]
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tuple(
                seq.token_ids[i * bs : (i + 1) * bs]
            ):
                # A hash collision (or a corrupted entry): never reuse it.
                self.num_verification_failures += 1
                logger.warning("prefix-cache block %d failed verification; not reused", block_id)
                break
            hits.append(block_id)
            parent = block_hash
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register the sequence's newly full blocks in the prefix cache: those
        within its first ``num_tokens`` tokens (default: those computed)."""
        upto = seq.num_computed_tokens if num_tokens is None else num_tokens
        num_full = upto // self.block_size
        if (
            not self.enable_prefix_caching
            or seq.hasher is None
            or num_full <= seq.num_cached_blocks
        ):
            return
        seq.update_block_hashes()
        bs = self.block_size
        for i in range(seq.num_cached_blocks, num_full):
            if seq.block_table[i] == NO_BLOCK:
                continue
            block = self.blocks[seq.block_table[i]]
            block_hash = seq.block_hashes[i]
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            block.parent_hash = seq.block_hashes[i - 1] if i else ROOT_HASH
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            if block_hash in self._hash_to_block:
                # Same content already cached in another block (computed twice
                # concurrently): hits go to the first, this one holds the hash
                # too, so that it outlives the first if it is evicted first.
                self._second_holders.setdefault(block_hash, set()).add(block.block_id)
                continue
            self._hash_to_block[block_hash] = block.block_id
            if self._record_events:
                self._events.pop(block_hash, None)
                self._events[block_hash] = True
        seq.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> int:
        """Evict every cached block no request holds; returns how many.

        Blocks in use keep their hashes (their content is valid and their
        requests are running); they become evictable when freed.
        """
        n = len(self._free_cached)
        for block_id in self._free_cached:
            self._unhash(self.blocks[block_id], spill=False)
            self._free_uncached.append(block_id)
        self._free_cached.clear()
        if self.host_tier is not None:
            n += self.host_tier.reset()
        return n

    def enable_events(self) -> None:
        """Start recording stored/removed hashes (nodes publish them to Redis)."""
        self._record_events = True
        if self.host_tier is not None:
            self.host_tier.record_events = True

    def take_events(self) -> CacheEvents:
        events, self._events = self._events, {}
        host_stored, host_removed = self.host_tier.take_events() if self.host_tier else ([], [])
        return CacheEvents(
            stored=[h for h, stored in events.items() if stored],
            removed=[h for h, stored in events.items() if not stored],
            host_stored=host_stored,
            host_removed=host_removed,
        )

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, prefix_blocks: Seq[int] = ()
    ) -> bool:
        """Grow ``seq.block_table`` so it holds ``num_new_tokens`` more tokens.

        ``prefix_blocks`` (from ``find_cached_prefix``, only for a sequence with no
        blocks yet) are claimed first and ``seq.num_computed_tokens`` moves past
        them. Returns False and changes nothing when too few blocks are free.
        """
        if not prefix_blocks:
            # The common case (a decode token, a prefill chunk): often no new block.
            bs = self.block_size
            needed = -(-(seq.num_computed_tokens + num_new_tokens) // bs) - len(seq.block_table)
            if needed <= 0:
                return True
        elif seq.block_table:
            raise RuntimeError("prefix blocks can only start an empty block table")
        num_prefix_tokens = len(prefix_blocks) * self.block_size
        total_tokens = seq.num_computed_tokens + num_prefix_tokens + num_new_tokens
        num_new_blocks = (
            self.blocks_needed(total_tokens) - len(seq.block_table) - len(prefix_blocks)
        )
        # Hit blocks sitting in the free LRU stop being free once claimed.
        num_revived = sum(1 for b in prefix_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - num_revived:
            return False
        for block_id in prefix_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if prefix_blocks:
            seq.num_computed_tokens += num_prefix_tokens
            seq.num_cached_blocks = len(prefix_blocks)
        if num_new_blocks > 0:
            taken = self._take_free_blocks(num_new_blocks)
            blocks = self.blocks
            for block_id in taken:
                blocks[block_id].ref_count = 1
            seq.block_table.extend(taken)
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Idempotent: a freed sequence holds none."""
        # Tail blocks go into the LRU first so they are evicted before the
        # prefix, which other requests are likelier to share.
        for block_id in reversed(seq.block_table):
            if block_id != NO_BLOCK:
                self._release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.num_window_freed_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the sequence's tail blocks past its first ``num_tokens``
        tokens (a verify step's rejected proposal held them). Such blocks are
        never in the prefix cache: only computed, verified blocks are."""
        keep = self.blocks_needed(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            self._release(table.pop())

    def free_blocks_before(self, seq: Sequence, position: int) -> int:
        """Release the sequence's blocks that hold only tokens before ``position``
        (every query from now on sees keys from ``position`` on: a sliding window
        has passed them); their entries become NO_BLOCK. Returns how many."""
        upto = min(position // self.block_size, len(seq.block_table))
        table = seq.block_table
        for i in range(seq.num_window_freed_blocks, upto):
            self._release(table[i])
            table[i] = NO_BLOCK
        freed = max(0, upto - seq.num_window_freed_blocks)
        seq.num_window_freed_blocks = max(upto, seq.num_window_freed_blocks)
        return freed

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._free_cached[block_id] = None
            else:
                self._free_uncached.append(block_id)

    def _take_free_blocks(self, n: int) -> list[int]:
        """``n`` free block ids (the caller checked there are): never-cached
        ones first, then the least recently freed cached ones, unhashed.

        In bulk because a prompt takes all its blocks at once, on a node's
        critical path: a 2048-token prompt takes 128 of them, and one Python
        call each added measurably to a decode node's reservation
        (docs/lab/2026-11-27-inline-commands-decode-node.md).

        In ascending order: which block holds which of the prompt's positions is
        free to choose, and runs of consecutive ids let a KV transfer gather them
        on the copy engines (engine/kv_blocks.py) -- freed blocks come back to
        the pools tail first, in descending order."""
        uncached = self._free_uncached
        if n <= len(uncached):
            taken = [uncached.popleft() for _ in range(n)]
        else:
            taken = list(uncached)
            uncached.clear()
            popitem = self._free_cached.popitem
            evicted = [popitem(last=False)[0] for _ in range(n - len(taken))]
            self._unhash_evicted(evicted)
            taken += evicted
        taken.sort()
        return taken

    def _unhash_evicted(self, block_ids: list[int]) -> None:
        """``_unhash`` of blocks taken from the cached LRU, the usual case (the
        block is its hash's only holder) inline."""
        blocks = self.blocks
        index = self._hash_to_block
        events = self._events if self._record_events else None
        tier = self.host_tier
        for block_id in block_ids:
            block = blocks[block_id]
            h = block.block_hash
            if h in self._second_holders or index.get(h) != block_id:
                self._unhash(block)
                continue
            del index[h]
            if events is not None:
                events.pop(h, None)
                events[h] = False
            if tier is not None:
                tier.spill(h, block.parent_hash, block.token_ids, block_id)
            block.block_hash = block.parent_hash = block.token_ids = None

    def _unhash(self, block: Block, spill: bool = True) -> None:
        """Forget the block's hash; ``spill``: keep its content in the host tier
        if the hash leaves this pool (an eviction, not a flush)."""
        h = block.block_hash
        if h is None:
            return
        others = self._second_holders.get(h)
        if self._hash_to_block.get(h) == block.block_id:
            if others:  # the hash stays cached in another block: no event
                self._hash_to_block[h] = others.pop()
            else:
                del self._hash_to_block[h]
                if self._record_events:
                    self._events.pop(h, None)
                    self._events[h] = False
                if spill and self.host_tier is not None:
                    self.host_tier.spill(h, block.parent_hash, block.token_ids, block.block_id)
        elif others is not None:
            others.discard(block.block_id)
        if others is not None and not others:
            del self._second_holders[h]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = None

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise RuntimeError if the pool's bookkeeping is inconsistent."""
        uncached = list(self._free_uncached)
        cached = list(self._free_cached)
        free = set(uncached) | set(cached)
        if len(free) != len(uncached) + len(cached):
            raise RuntimeError("a block is listed twice in the free pools")
        used = [b for b in self.blocks if b.ref_count > 0]
        if any(b.ref_count < 0 for b in self.blocks):
            raise RuntimeError("negative reference count")
        if any(self.blocks[i].ref_count != 0 for i in free):
            raise RuntimeError("a free block has a non-zero reference count")
        if len(free) + len(used) != self.num_blocks:
            raise RuntimeError(
                f"free ({len(free)}) + used ({len(used)}) != total ({self.num_blocks})"
            )
        if any(self.blocks[i].block_hash is not None for i in uncached):
            raise RuntimeError("an uncached free block still carries a hash")
        if any(self.blocks[i].block_hash is None for i in cached):
            raise RuntimeError("a cached free block has no hash")
        for h, block_id in self._hash_to_block.items():
            if self.blocks[block_id].block_hash != h:
                raise RuntimeError(f"hash index points at block {block_id} with another hash")
        for h, holders in self._second_holders.items():
            if h not in self._hash_to_block or not holders:
                raise RuntimeError("a second holder of a hash that is not cached")
            if any(self.blocks[b].block_hash != h for b in holders):
                raise RuntimeError("a second holder carries another hash")
        hashed = sum(b.block_hash is not None for b in self.blocks)
        if hashed != len(self._hash_to_block) + sum(map(len, self._second_holders.values())):
            raise RuntimeError("a hashed block is in neither the hash index nor its holders")
