"""The host tier's memory and the copies between it and the device's KV cache.

engine/host_tier.py decides which block goes to which slot; this module moves
the bytes. The tier is one tensor shaped like the device cache with slots for
blocks, ``[2, num_layers, num_slots, block_size, kv_heads, head_dim]``, in
pinned memory where the cache is on a GPU (plain CPU memory otherwise: on a
CPU engine both "tiers" are host memory, and the same bookkeeping runs).

A step's copies go as one batch each way, whatever the number of blocks:

- to the host: one gather kernel (``index_select`` over the evicted blocks)
  into a contiguous buffer, one device-to-host copy of it into a pinned
  staging buffer, and, once that has landed, one ``index_copy_`` on the host
  into the slots;
- to the device: one ``index_select`` on the host out of the slots into a
  pinned staging buffer, one host-to-device copy, one ``index_copy_`` kernel
  into the blocks.

On a GPU they run on a copy stream of their own, ordered as follows. The copy
stream first waits for everything the compute stream has queued (the steps
that wrote the blocks being copied out, and any step in flight that may still
write a freed block being loaded into). The compute stream then waits for the
gather only (an event right after it), not for the transfer over the bus: an
evicted block may be written by the very next step, and the gather has read
it by then. Loads are waited for by no one but their sequences, which the
scheduler runs only once the engine saw their event complete
(``TierTransfers.poll``). Copies to the host are read before loads on the one
stream, so a block that spills and is loaded into in the same step is read
before it is overwritten. On a CPU every copy is done when ``flush`` returns.

Tensor parallelism: each rank's cache holds its heads of every block, so each
rank has a ``TierCopier`` of its own (its heads of every slot, its own pinned
memory and copy stream) and issues the same batches. Rank 0's
``TierTransfers`` takes them from the bookkeeping and sends each to the
others in the step hand-off before issuing it (``TierPlan``); a rank retires
its batches up to the count rank 0 had retired, named in each plan, before
it issues the next batch or runs the next step: a load rank 0 saw land, and
the step that reads it, then find this rank's copy landed too.

Pinned staging memory is the copier's own (``StagingPool``), taken by a batch
and given back when it retires. Allocating page-locked memory is one of
CUDA's implicit synchronization points: the host waits for every stream, so
a batch that allocated its staging buffer would hold the engine thread until
the step in flight and every queued copy had finished. The pool allocates
only when a batch outgrows every free buffer, doubling, so a run of a given
shape stops allocating after its first batches.

Why not engine/copy_engine.py's pitched copies: they move runs of consecutive
blocks device to device, a driver call per run; evicted blocks and the slots
they go to are scattered, so a gather into one contiguous buffer and a single
bus copy cost one launch each whatever the layout.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.host_tier import HostTier, TierCopies, TierPlan
from engine.sequence import Sequence


@dataclass(slots=True)
class CopyBatch:
    """One step's copies in flight."""

    copies: TierCopies
    # Rank 0's sequences whose blocks the copies to the device fill (none on
    # the other ranks: rank 0 tells them when to run).
    loads: list[Sequence]
    done: torch.cuda.Event | None = None  # None: done (a CPU)
    # Copies to the host land here first; ``slots`` get them once done.
    staged: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until done
    staging: torch.Tensor | None = None  # the pool's buffer, given back on retire
    # The copy to the device, timed: the host's gather out of the slots plus
    # the bus copy (a GPU: events on the copy stream around it, read once
    # done; a CPU: the synchronous copy's wall time), so the tier's copy-in
    # rate can be set against the host's plain copy rate.
    copy_in: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    copy_in_s: float = 0.0

    def is_done(self) -> bool:
        return self.done is None or self.done.query()


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


# Views carved from a staging buffer start at multiples of this many bytes
# (any dtype's alignment).
_ALIGN = 64
# Blocks each way that the pool's first buffers hold.
_FIRST_BLOCKS = 4


class StagingPool:
    """Pinned byte buffers that copy batches take and give back (see the module
    docstring: why a batch must not allocate pinned memory itself)."""

    def __init__(self, first_bytes: int, count: int = 2, pin: bool = True) -> None:
        self.pin = pin  # False only where no GPU can pin (the pool's own tests)
        self._free = [self._allocate(first_bytes) for _ in range(count)]
        self.largest = first_bytes
        self.num_allocations = count

    def _allocate(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def take(self, num_bytes: int) -> torch.Tensor:
        """The smallest free buffer of at least ``num_bytes``; a new one (twice
        the largest so far, or more) when none fits."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        self.largest = max(num_bytes, 2 * self.largest)
        self.num_allocations += 1
        return self._allocate(self.largest)

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    @property
    def num_free(self) -> int:
        return len(self._free)


class _Carver:
    """Consecutive aligned views of one staging buffer."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.at = 0

    @staticmethod
    def size(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """The bytes views of ``shapes``, carved in that order, take."""
        total = 0
        for shape, dtype in shapes:
            _, total = _span(total, shape, dtype)
        return total

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        start, self.at = _span(self.at, shape, dtype)
        return self.buf[start : self.at].view(dtype).view(shape)


def _span(at: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """Where a view of ``shape`` carved after ``at`` bytes starts (aligned) and ends."""
    start = -(-at // _ALIGN) * _ALIGN
    return start, start + math.prod(shape) * dtype.itemsize


class TierCopier:
    """One rank's host tier: its memory (this rank's heads of every slot) and
    the copies in flight, retired in issue order. Every rank holds one and
    issues the same batches (rank 0's ``TierTransfers`` decides them, the
    other ranks get them in the step hand-off), so the ranks' batches are
    numbered alike and "rank 0 retired n batches" means the same copies on
    every rank."""

    def __init__(self, kv_cache: torch.Tensor, num_slots: int) -> None:
        self.kv_cache = kv_cache
        self.num_slots = num_slots
        self.on_cuda = kv_cache.is_cuda
        shape = (*kv_cache.shape[:2], num_slots, *kv_cache.shape[3:])
        # Lazy on a CPU (pages are committed as slots fill); pinned on a GPU
        # host, so copies to and from it never go through pageable memory.
        self.host = torch.empty(shape, dtype=kv_cache.dtype, pin_memory=self.on_cuda)
        self.stream = torch.cuda.Stream(kv_cache.device) if self.on_cuda else None
        # Allocated now, before serving: see StagingPool.
        self.staging = (
            StagingPool(2 * _FIRST_BLOCKS * self.block_bytes + 4 * _ALIGN) if self.on_cuda else None
        )
        self._in_flight: deque[CopyBatch] = deque()
        self.num_retired = 0  # batches retired since start

    @property
    def block_bytes(self) -> int:
        """One block's bytes on this rank (its heads)."""
        kv = self.kv_cache
        return kv.numel() // kv.shape[2] * kv.element_size()

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def issue(self, copies: TierCopies, loads: list[Sequence] = ()) -> None:
        """Queue one batch: every copy to the host, then every copy to the device."""
        batch = CopyBatch(copies, list(loads))
        # Without copies it is done at once (a wait for the other ranks' batches).
        if copies:
            (self._issue_cuda if self.on_cuda else self._issue_cpu)(batch)
        self._in_flight.append(batch)

    def retire(self, wait: bool = False, until: int | None = None) -> list[CopyBatch]:
        """The batches now done, in issue order: those done already, or every
        one (``wait``), or (``until``) as many as make ``num_retired`` reach it,
        waiting for them (a rank catching up with what rank 0 retired)."""
        retired: list[CopyBatch] = []
        while self._in_flight:
            batch = self._in_flight[0]
            if until is not None:
                if self.num_retired >= until:
                    break
            elif not (wait or batch.is_done()):
                break
            self._in_flight.popleft()
            if batch.done is not None:
                batch.done.synchronize()
            if batch.copy_in is not None:
                start, end = batch.copy_in
                batch.copy_in_s += start.elapsed_time(end) / 1e3
            if batch.staged is not None:
                self.host.index_copy_(2, batch.slots, batch.staged)
            if batch.staging is not None:
                self.staging.give(batch.staging)
                batch.staging = batch.staged = None
            self.num_retired += 1
            retired.append(batch)
        return retired

    def _issue_cpu(self, batch: CopyBatch) -> None:
        kv, host = self.kv_cache, self.host
        if batch.copies.to_host:
            blocks, slots = zip(*batch.copies.to_host, strict=True)
            host.index_copy_(
                2, _index(slots, host.device), kv.index_select(2, _index(blocks, kv.device))
            )
        if batch.copies.to_device:
            slots, blocks = zip(*batch.copies.to_device, strict=True)
            start = time.perf_counter()
            kv.index_copy_(
                2, _index(blocks, kv.device), host.index_select(2, _index(slots, host.device))
            )
            batch.copy_in_s = time.perf_counter() - start

    def _issue_cuda(self, batch: CopyBatch) -> None:
        kv, stream = self.kv_cache, self.stream
        compute = torch.cuda.current_stream(kv.device)
        outs, ins = batch.copies.to_host, batch.copies.to_device
        # Index tensors and buffers first, on the compute stream (the memory
        # the engine's budget knows): the copy stream's wait below orders it
        # after their uploads and after every write already queued.
        i64 = torch.int64
        shapes = [((len(outs),), i64), (self._shape(len(outs)), kv.dtype)] if outs else []
        shapes += [((len(ins),), i64), (self._shape(len(ins)), kv.dtype)] if ins else []
        batch.staging = self.staging.take(_Carver.size(shapes))
        carve = _Carver(batch.staging)
        out_idx = in_idx = None
        if outs:
            blocks, slots = zip(*outs, strict=True)
            out_idx = self._upload(carve, blocks)
            batch.staged = carve.view(self._shape(len(blocks)), kv.dtype)
            out = self._for_copy_stream(kv.new_empty(batch.staged.shape))
            batch.slots = torch.tensor(slots, dtype=i64)
            batch.keep.append(out)
        if ins:
            slots, blocks = zip(*ins, strict=True)
            in_idx = self._upload(carve, blocks)
            src = carve.view(self._shape(len(slots)), kv.dtype)
            gather_began = time.perf_counter()
            torch.index_select(self.host, 2, torch.tensor(slots, dtype=i64), out=src)
            # The host's gather is part of what a load costs, beside the bus copy.
            batch.copy_in_s = time.perf_counter() - gather_began
            landed = self._for_copy_stream(kv.new_empty(src.shape))
            batch.keep.append(landed)
        stream.wait_stream(compute)
        gathered = None
        with torch.cuda.stream(stream):
            if out_idx is not None:
                torch.index_select(kv, 2, out_idx, out=out)
                gathered = torch.cuda.Event()
                gathered.record(stream)
                batch.staged.copy_(out, non_blocking=True)
            if in_idx is not None:
                batch.copy_in = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                batch.copy_in[0].record(stream)
                landed.copy_(src, non_blocking=True)
                batch.copy_in[1].record(stream)
                kv.index_copy_(2, in_idx, landed)
            batch.done = torch.cuda.Event()
            batch.done.record(stream)
        if gathered is not None:
            compute.wait_event(gathered)  # evicted blocks are free to rewrite after it

    def _upload(self, carve: _Carver, ids: tuple[int, ...]) -> torch.Tensor:
        """Block ids on the device, through the batch's pinned staging."""
        host = carve.view((len(ids),), torch.int64)
        host.copy_(torch.tensor(ids, dtype=torch.int64))
        dev = host.to(self.kv_cache.device, non_blocking=True)
        return self._for_copy_stream(dev)

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        kv = self.kv_cache
        return (*kv.shape[:2], num_blocks, *kv.shape[3:])

    def _for_copy_stream(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the compute stream's pool (the memory the engine's budget
        knows) that the copy stream uses: not reused before the copy stream's
        use of it is done."""
        t.record_stream(self.stream)
        return t


class TierTransfers:
    """Rank 0's side of the host tier: the bookkeeping's copies issued on every
    rank as one batch a step, and the sequences they load reported once landed.
    ``send``: how the other tensor-parallel ranks get each batch (the step
    hand-off, engine/parallel/handoff.py), before rank 0 issues its own."""

    def __init__(
        self,
        tier: HostTier,
        copier: TierCopier,
        send: Callable[[TierPlan], None] | None = None,
    ) -> None:
        self.tier = tier
        self.copier = copier
        self.send = send

    @property
    def busy(self) -> bool:
        return self.copier.busy

    def flush(self, loads: list[Sequence], wait: bool = False) -> None:
        """Issue the copies the tier queued (``loads``: the sequences they fill).
        Before the next step is launched: that step may reuse evicted blocks.
        ``wait``: the caller then waits for every batch (``poll(wait=True)``);
        the other ranks are told to as well, even with nothing new to copy
        (they may still be copying batches rank 0 saw land)."""
        copies = self.tier.take_copies()
        others = self.send is not None
        if not (copies or loads or (wait and (self.copier.busy or others))):
            return
        if self.send is not None:
            self.send(TierPlan(copies, self.copier.num_retired, wait))
        self.copier.issue(copies, loads)
        self.tier.copies_issued(copies)  # the loads have read their slots

    def poll(self, wait: bool = False) -> list[Sequence]:
        """Retire the batches that are done (all of them with ``wait``), in
        issue order; returns the sequences whose loads landed."""
        loaded: list[Sequence] = []
        for batch in self.copier.retire(wait):
            self.tier.landed(batch.copies)
            self.tier.stats.seconds_to_device += batch.copy_in_s
            loaded.extend(batch.loads)
        return loaded
