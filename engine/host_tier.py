"""The host tier's bookkeeping: which host slot holds which KV block.

Pure Python, no torch (the copies themselves are engine/tier_copies.py's).
A slot holds one KV block in host memory. Like a device block
(engine/block_manager.py) every slot is in exactly one place:

- the free queue (no content),
- the cached LRU (a prefix-cache block spilled from the device pool, keyed by
  its block hash; reference count 0; the least recently used is evicted first
  when a slot is needed),
- held (reference count >= 1: a swapped-out sequence owns it, or a copy back
  to the device reads it this step), or landing (a copy from the device is
  writing it). Neither held nor landing slots are ever evicted.

A spilled slot is not a hit until its copy has landed: a hit reads the slot,
and a copy in flight may not have written it yet.

Every copy is queued here as (device block, slot) pairs and taken once a step
by the engine (``take_copies``), which moves them all in one batch and tells
when they landed (``landed``). Hashes are hints here as on the device: a hit
is verified against the block's parent hash and tokens.

With ``record_events`` the tier records which hashes became hits (a spill
landed) and which left it (evicted, flushed), for nodes to publish to Redis
beside the device pool's (engine/block_manager.py ``CacheEvents``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.block_hash import ROOT_HASH


@dataclass(slots=True)
class HostSlot:
    slot_id: int
    ref_count: int = 0
    landing: bool = False  # a copy from the device is writing it
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class TierCopies:
    """The copies queued since the last take, in the order they must run:
    every copy to the host before any copy to the device (a block that
    spills is read before a load into it overwrites it)."""

    # (device block, host slot): spills of evicted blocks and swap-outs.
    to_host: list[tuple[int, int]] = field(default_factory=list)
    # (host slot, device block): prefix hits and swap-ins.
    to_device: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.to_host or self.to_device)


@dataclass(slots=True)
class TierPlan:
    """One batch of copies as every tensor-parallel rank issues it: each rank
    holds its own heads of every slot, so each runs the same copies on the same
    block and slot ids (rank 0 decides them; engine/parallel/handoff.py carries
    them to the others in order with the steps)."""

    copies: TierCopies
    # Batches rank 0 had retired before this one: another rank retires its own
    # up to there first (a copy to the device may read a slot they wrote).
    landed: int
    wait: bool = False  # rank 0 waits for every batch so far: so must the others


@dataclass(slots=True)
class HostTierStats:
    hit_blocks: int = 0  # prefix blocks served from the host tier
    blocks_to_host: int = 0  # blocks copied device -> host (spills and swap-outs)
    blocks_to_device: int = 0  # blocks copied host -> device (hits and swap-ins)
    # Rank 0's bus time for those copies (engine/tier_copies.py times them).
    seconds_to_device: float = 0.0
    spills_skipped: int = 0  # evicted blocks not kept: no slot could be freed


class HostTier:
    def __init__(self, num_slots: int, record_events: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slots = [HostSlot(i) for i in range(num_slots)]
        self._free: deque[int] = deque(range(num_slots))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, landed
        self._hash_to_slot: dict[bytes, int] = {}
        self._copies = TierCopies()
        self.stats = HostTierStats()
        self.record_events = record_events
        # hash -> True (now a hit) / False (gone); the last event wins.
        self._events: dict[bytes, bool] = {}

    # ----------------------------------------------------------------- counts
    @property
    def num_free_slots(self) -> int:
        """Slots a spill or swap-out can take: empty ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_slots(self) -> int:
        return len(self._hash_to_slot)

    def cached_hashes(self) -> list[bytes]:
        """Every hash a hit can find once landed (a snapshot for resyncs)."""
        return [h for h, s in self._hash_to_slot.items() if not self.slots[s].landing]

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, removed) since the last take: hashes that became hits, hashes that left."""
        events, self._events = self._events, {}
        return (
            [h for h, stored in events.items() if stored],
            [h for h, stored in events.items() if not stored],
        )

    def lru_hashes(self) -> list[bytes]:
        """The evictable cached hashes, least recently used first."""
        return [self.slots[s].block_hash for s in self._lru]

    # ------------------------------------------------------------------- hits
    def find_prefix(
        self, block_hashes: Seq[bytes], token_ids: Seq[int], block_size: int, start: int, limit: int
    ) -> list[int]:
        """Slots holding blocks ``start``, ``start + 1``, ... (below ``limit``) of a
        sequence with these block hashes and tokens: the longest verified run of
        landed hits. Not claimed: ``hold`` them before anything can evict."""
        hits: list[int] = []
        parent = block_hashes[start - 1] if start else ROOT_HASH
        for i in range(start, limit):
            slot_id = self._hash_to_slot.get(block_hashes[i])
            if slot_id is None:
                break
            slot = self.slots[slot_id]
            if slot.landing or slot.parent_hash != parent:
                break
            if slot.token_ids != tuple(token_ids[i * block_size : (i + 1) * block_size]):
                break
            hits.append(slot_id)
            parent = slot.block_hash
        return hits

    def all_landed(self, slot_ids: Seq[int]) -> bool:
        return not any(self.slots[s].landing for s in slot_ids)

    def hold(self, slot_ids: Seq[int]) -> None:
        """Keep these slots from eviction (a load about to read them)."""
        for slot_id in slot_ids:
            slot = self.slots[slot_id]
            if slot.ref_count == 0 and not slot.landing:
                del self._lru[slot_id]
            slot.ref_count += 1

    def release(self, slot_ids: Seq[int]) -> None:
        """Drop one reference from each slot: a cached one goes to the LRU's
        most recent end, an uncached one (a swap-out's tail) to the free queue."""
        for slot_id in slot_ids:
            slot = self.slots[slot_id]
            if slot.ref_count <= 0:
                raise RuntimeError(f"double release of host slot {slot_id}")
            slot.ref_count -= 1
            self._settle(slot)

    # ----------------------------------------------------------------- copies
    def spill(
        self, block_hash: bytes, parent_hash: bytes, token_ids: tuple[int, ...], device_block: int
    ) -> None:
        """A cached device block is being evicted: keep a copy, unless its hash is
        here already (then it only becomes the most recently used) or every
        slot is held."""
        slot_id = self._hash_to_slot.get(block_hash)
        if slot_id is not None:
            if slot_id in self._lru:
                self._lru.move_to_end(slot_id)
            return
        taken = self._take(1)
        if not taken:
            self.stats.spills_skipped += 1
            return
        slot = self.slots[taken[0]]
        slot.block_hash, slot.parent_hash, slot.token_ids = block_hash, parent_hash, token_ids
        self._hash_to_slot[block_hash] = slot.slot_id
        slot.landing = True
        self._copies.to_host.append((device_block, slot.slot_id))

    def swap_out(self, device_blocks: Seq[int]) -> list[int] | None:
        """Slots for a preempted sequence's blocks, owned by it (reference 1)
        until ``release``, their copies queued; None (nothing changed) when the
        tier cannot free that many."""
        if len(device_blocks) > self.num_free_slots:
            return None
        taken = self._take(len(device_blocks))
        for block_id, slot_id in zip(device_blocks, taken, strict=True):
            slot = self.slots[slot_id]
            slot.ref_count, slot.landing = 1, True
            self._copies.to_host.append((block_id, slot_id))
        return taken

    def load(self, slot_ids: Seq[int], device_blocks: Seq[int]) -> None:
        """Queue copies of held slots into device blocks. Each slot keeps one
        reference until its copy is issued (``copies_issued`` drops it)."""
        if any(self.slots[s].landing for s in slot_ids):
            raise RuntimeError("a load of a host slot whose copy has not landed")
        self._copies.to_device.extend(zip(slot_ids, device_blocks, strict=True))

    def take_copies(self) -> TierCopies:
        copies, self._copies = self._copies, TierCopies()
        self.stats.blocks_to_host += len(copies.to_host)
        self.stats.blocks_to_device += len(copies.to_device)
        return copies

    def copies_issued(self, copies: TierCopies) -> None:
        """The copies' reads of host memory are done: their slots' load references go."""
        self.release([slot_id for slot_id, _ in copies.to_device])

    def landed(self, copies: TierCopies) -> None:
        """The copies to the host have written their slots: spills become hits."""
        for _, slot_id in copies.to_host:
            slot = self.slots[slot_id]
            slot.landing = False
            if self.record_events and slot.block_hash is not None:
                self._record(slot.block_hash, True)
            self._settle(slot)

    # ---------------------------------------------------------------- helpers
    def _settle(self, slot: HostSlot) -> None:
        if slot.ref_count or slot.landing:
            return
        if slot.block_hash is not None:
            self._lru[slot.slot_id] = None
        else:
            self._free.append(slot.slot_id)

    def _take(self, n: int) -> list[int]:
        """Up to ``n`` empty slots: free ones first, then the least recently used."""
        taken: list[int] = []
        while len(taken) < n and self._free:
            taken.append(self._free.popleft())
        while len(taken) < n and self._lru:
            slot_id, _ = self._lru.popitem(last=False)
            self._forget(self.slots[slot_id])
            taken.append(slot_id)
        return taken

    def _forget(self, slot: HostSlot) -> None:
        if slot.block_hash is not None and self._hash_to_slot.get(slot.block_hash) == slot.slot_id:
            del self._hash_to_slot[slot.block_hash]
            if self.record_events:
                self._record(slot.block_hash, False)
        slot.block_hash = slot.parent_hash = slot.token_ids = None

    def _record(self, block_hash: bytes, stored: bool) -> None:
        self._events.pop(block_hash, None)
        self._events[block_hash] = stored

    def reset(self) -> int:
        """Drop every evictable cached slot; returns how many."""
        n = len(self._lru)
        for slot_id in self._lru:
            self._forget(self.slots[slot_id])
            self._free.append(slot_id)
        self._lru.clear()
        return n

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise RuntimeError if the tier's bookkeeping is inconsistent."""
        free, lru = list(self._free), list(self._lru)
        if len(set(free) | set(lru)) != len(free) + len(lru):
            raise RuntimeError("a host slot is listed twice in the free pools")
        busy = [s for s in self.slots if s.ref_count > 0 or s.landing]
        if len(free) + len(lru) + len(busy) != self.num_slots:
            raise RuntimeError(
                f"free ({len(free)}) + cached ({len(lru)}) + busy ({len(busy)}) "
                f"!= total ({self.num_slots})"
            )
        if any(self.slots[s].ref_count or self.slots[s].landing for s in free + lru):
            raise RuntimeError("a free host slot is held or landing")
        if any(self.slots[s].block_hash is not None for s in free):
            raise RuntimeError("an empty host slot carries a hash")
        for h, slot_id in self._hash_to_slot.items():
            if self.slots[slot_id].block_hash != h:
                raise RuntimeError(f"host index points at slot {slot_id} with another hash")
