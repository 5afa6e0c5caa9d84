"""What one rank of a decode node does with the KV that lands on it.

The receiver (common/kv_transfer/receiver.py) calls ``on_group`` with each
group's segment headers and ``on_chunk`` with each chunk, on its threads. A
segment must fit its reservation and continue what was announced before
(common/kv_transfer/coverage.py: per layer and KV head of this rank); its
chunks are scattered into the reserved blocks as they land (on the receiver's
CUDA stream, with an event recorded after them). Whatever arrives for a
reservation that is no longer RESERVED or STREAMING is dropped, never written,
and counted as late once per segment.

Rank 0 (decode_node/kv_landing.py) and the other ranks of a tensor-parallel
node (decode_node/tp_rank.py) share this; they differ in what happens when
this rank's part of a reservation has landed or failed (``_landed``,
``_failed``), and in how late drops are counted (``_late``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field

import torch

from common.kv_transfer import TransferError, TransferState
from common.kv_transfer.checksum import checksum
from common.kv_transfer.coverage import Coverage
from common.kv_transfer.protocol import ChunkDesc, FirstToken, SegmentHeader
from engine.kv_blocks import block_index, kv_unit_bytes
from engine.llm_engine import Reservation

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingKV:
    """A reservation waiting for its prompt's KV on this rank (shared with the
    receiver's threads)."""

    request_id: str
    reservation: Reservation
    peer: str
    coverage: Coverage
    peer_tp: int = 1  # the prefill node's ranks (which of them send to this one)
    reservation_id: int = 0
    state: TransferState = TransferState.RESERVED
    landed_event: torch.cuda.Event | None = None  # behind the last scatter queued
    digests: list[bytes] = field(default_factory=list)  # per chunk, with --verify-kv
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Rank 0 only: the request path's future, and the other ranks whose part
    # has not landed yet.
    landed: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    ranks_left: int = 0
    # Rank 0: the prompt's first token once it and this rank's KV landed
    # (protocol.FLAG_TOKEN), None if none will come (the channel failed); and
    # the token, where it came before the rest of this rank's KV (from a prefill
    # node of several ranks, the others' chunks may land after it).
    first_token: asyncio.Future | None = None
    token: FirstToken | None = None
    # Rank 0 with --verify-kv: the checksum the prefill node's end header carries.
    end_digest: asyncio.Future | None = None

    def resolve(self, error: BaseException | None = None) -> None:
        def done() -> None:
            if not self.landed.done():
                if error is None:
                    self.landed.set_result(None)
                else:
                    self.landed.set_exception(error)

        self.loop.call_soon_threadsafe(done)

    def give_token(self, token: FirstToken | None) -> None:
        _settle_soon(self.loop, self.first_token, token)

    def give_digest(self, digest: bytes) -> None:
        _settle_soon(self.loop, self.end_digest, digest)


def _settle_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
    """Resolve ``future`` with ``value`` on its loop (from a receiver's thread)."""

    def done() -> None:
        if not future.done():
            future.set_result(value)

    loop.call_soon_threadsafe(done)


@dataclass(slots=True)
class _Segment:
    """The landing's view of one announced segment (the receiver hands it back per chunk)."""

    header: SegmentHeader
    pending: PendingKV | None = None  # None: not wanted
    index: torch.Tensor | None = None  # its reserved blocks, as an index tensor
    dropped: bool = False  # counted (late) or failed already


class LandingCore:
    """Reservations of one rank and the scatter of what lands for them."""

    def __init__(self, runner, stats, verify_transfers: bool) -> None:
        self.stats = stats
        self.verify_transfers = verify_transfers
        self._runner = runner
        kv = runner.kv_cache
        heads = runner.layout.kv_heads  # global indices: what headers name
        self._layout = (kv.shape[1], (heads.start, heads.stop), kv_unit_bytes(kv))
        self._head_base = heads.start
        self._pending: dict[int, PendingKV] = {}

    def _coverage(self, reservation: Reservation) -> Coverage:
        num_layers, heads, unit_bytes = self._layout
        return Coverage(
            reservation.first_block, len(reservation.block_ids), num_layers, heads, unit_bytes
        )

    # ------------------------------------------------- what the roles decide
    def _landed(self, pending: PendingKV) -> None:
        """This rank's part of ``pending`` landed (outside its lock)."""
        raise NotImplementedError

    def _failed(self, pending: PendingKV, error: TransferError) -> None:
        """This rank's part of ``pending`` failed (outside its lock)."""
        raise NotImplementedError

    def _late(self) -> None:
        self.stats.late_transfers += 1

    def _lookup(self, reservation_id: int) -> PendingKV | None:
        return self._pending.get(reservation_id)

    # --------------------------------------------------- receiver threads
    def on_group(self, peer: str, headers: list[SegmentHeader]) -> list[_Segment]:
        return [self._announce(peer, h) for h in headers]

    def _announce(self, peer: str, header: SegmentHeader) -> _Segment:
        seg = _Segment(header)
        pending = self._lookup(header.reservation_id)
        if pending is None or pending.peer != peer:
            if not header.is_end:
                self._drop(seg, late=True)
                logger.info("dropping KV for reservation %d, which is gone", header.reservation_id)
            return seg
        error = None
        if header.is_end and pending.end_digest is not None:
            pending.give_digest(header.digest)
        with pending.lock:
            if header.is_end:
                if pending.state in OPEN and not pending.coverage.announced_all(header.heads):
                    error = self._mark_failed(
                        pending, "the prefill node ended the stream before all KV came"
                    )
            elif pending.state not in OPEN:
                self._drop(seg, late=pending.state in GONE)
            elif (why := pending.coverage.accept(header)) is not None:
                error = self._mark_failed(
                    pending, f"a KV segment for {pending.request_id} does not fit: {why}"
                )
                seg.dropped = True
            else:
                pending.state = TransferState.STREAMING
                blocks = pending.reservation.block_ids[header.block_start : header.block_end]
                seg.index = block_index(blocks, self._runner.device)
                seg.pending = pending
        if error is not None:
            self._failed(pending, error)
        return seg

    def on_chunk(self, peer: str, seg: _Segment, desc: ChunkDesc, data: torch.Tensor, stream):
        pending = seg.pending
        if pending is None or seg.dropped:
            return
        error = None
        complete = False
        with pending.lock:
            if pending.state is not TransferState.STREAMING:
                self._drop(seg, late=pending.state in GONE)
                return
            try:
                self._place(pending, seg.index, desc, data, stream)
            except Exception as e:
                error = self._mark_failed(
                    pending, f"could not place the KV of {pending.request_id}: {e}"
                )
                seg.dropped = True
            else:
                self.stats.bytes_received += data.numel()
                complete = pending.coverage.land(desc)
                if complete:
                    pending.state = TransferState.LANDED
        if error is not None:
            self._failed(pending, error)
        elif complete:
            if pending.token is not None:
                pending.give_token(pending.token)
            self._landed(pending)

    def on_first_token(self, peer: str, seg: _Segment, token: FirstToken) -> None:
        """The prompt's first token, behind its last segment's chunks: taken once
        all of the reservation's KV landed on this rank (-1: the prefill node
        had none to send: the transfer fails)."""
        pending = seg.pending
        if pending is None or seg.dropped or pending.first_token is None:
            return
        with pending.lock:
            if pending.state not in OPEN + (TransferState.LANDED,):
                return  # failed or gone
            if token.token_id < 0:
                error = self._mark_failed(pending, "the prefill node sampled no first token")
            else:
                pending.token = token
                landed = pending.state is TransferState.LANDED
        if token.token_id < 0:
            self._failed(pending, error)
            pending.give_token(None)
        elif landed:  # else once the rest of this rank's KV landed (on_chunk)
            pending.give_token(token)

    def _place(self, pending: PendingKV, index, desc: ChunkDesc, data, stream) -> None:
        runner = self._runner
        # Headers name global KV heads; this rank's cache holds its own from 0.
        heads = (desc.head_start - self._head_base, desc.head_end - self._head_base)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            runner.scatter_kv(index, data, desc.layers, heads)
            if stream is not None:
                pending.landed_event = torch.cuda.Event()
                pending.landed_event.record(stream)
            if self.verify_transfers:
                pending.digests.append(checksum(runner.gather_kv(index, desc.layers, heads)))

    def _drop(self, seg: _Segment, late: bool) -> None:
        if not seg.dropped:
            seg.dropped = True
            if late:
                self._late()

    @staticmethod
    def _mark_failed(pending: PendingKV, message: str) -> TransferError:
        """Under the pending's lock."""
        pending.state = TransferState.FAILED
        return TransferError(message)

    def fail_peer(self, peer: str, error: Exception) -> None:
        """Every open reservation from ``peer`` fails (its channel broke); a first
        token still awaited from it will not come."""
        for pending in list(self._pending.values()):
            if pending.peer == peer and pending.first_token is not None:
                pending.give_token(None)  # a no-op once it came
            with pending.lock:
                if pending.peer != peer or pending.state not in OPEN:
                    continue
                pending.state = TransferState.FAILED
            self.stats.transfer_failures += 1
            self._failed(pending, TransferError(f"KV channel from {peer} failed: {error}"))

    # ------------------------------------------------- the engine's stream
    def order_after_landing(self, pending: PendingKV) -> None:
        """The engine's stream waits for the last scatter queued for ``pending``
        (before its blocks are read, or freed for reuse). The device is named:
        this may run on a thread other than the engine's (an inline command)."""
        if pending.landed_event is not None:
            torch.cuda.current_stream(self._runner.device).wait_event(pending.landed_event)


# Still waiting for KV; and gone (whatever arrives for those is late).
OPEN = (TransferState.RESERVED, TransferState.STREAMING)
GONE = (TransferState.ABORTED, TransferState.EXPIRED)
