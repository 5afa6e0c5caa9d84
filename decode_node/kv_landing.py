"""The decode node's KV landing: reservations filled chunk by chunk as a prefill node streams.

Life cycle of one reservation (``TransferState``):

1. RESERVED -- ``open`` registers the engine's reservation under a fresh id
   (ids are never reused: the id is the blocks' generation) and tells the
   receiver to expect that prefill node's stream; the request path sends the
   id, the channel epoch and the first missing block in its ``Prefill``.
2. STREAMING -- the receiver read a segment header naming it (``on_group``,
   the receiver's thread). The segment must fit the reservation and continue
   what was announced before (common/kv_transfer/coverage.py); one that does
   not fails the reservation. Each of its chunks is scattered into the
   reserved blocks as it lands (``on_chunk``: on the receiver's CUDA stream,
   with an event recorded after it), while the later chunks are on the wire.
3. LANDED -- the last unit (block x layer x head) landed: the request path's
   ``landed`` future resolves.
4. COMMITTED -- ``commit`` runs on the engine thread: it orders the engine's
   stream after the last scatter and makes the request join the running batch
   with the prefill node's first token.
Or EXPIRED (the lease ran out first: ``expire``), FAILED (the channel from that
peer failed, a segment did not fit, a scatter failed, or the prefill node ended
the stream early) or ABORTED (the request ended first; ``close`` marks whatever
is still open). In each of those cases the request path aborts the engine
request, which frees the blocks -- after the last scatter that was queued
(``wait_for_landings``). Whatever arrives for a reservation that is no longer
RESERVED or STREAMING (a segment for a reservation that is gone, the rest of a
segment whose lease ran out half-way) is dropped, never written, and counted
as late once per segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer import KVReceiver, TransferError, TransferState
from common.kv_transfer.checksum import chain, checksum
from common.kv_transfer.coverage import Coverage
from common.kv_transfer.protocol import ChunkDesc, SegmentHeader
from decode_node.stats import DecodeStats
from engine.kv_blocks import block_index, kv_unit_bytes
from engine.llm_engine import LLMEngine, Reservation

if TYPE_CHECKING:
    from engine.sequence import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingKV:
    """A reservation waiting for its prompt's KV (shared with the receiver thread)."""

    request_id: str
    reservation: Reservation
    peer: str
    landed: asyncio.Future
    loop: asyncio.AbstractEventLoop
    coverage: Coverage
    state: TransferState = TransferState.RESERVED
    landed_event: torch.cuda.Event | None = None  # behind the last scatter queued
    digests: list[bytes] = field(default_factory=list)  # per chunk, with --verify-kv
    lock: threading.Lock = field(default_factory=threading.Lock)

    def resolve(self, error: BaseException | None = None) -> None:
        def done() -> None:
            if not self.landed.done():
                if error is None:
                    self.landed.set_result(None)
                else:
                    self.landed.set_exception(error)

        self.loop.call_soon_threadsafe(done)


@dataclass(slots=True)
class _Segment:
    """The landing's view of one announced segment (the receiver hands it back per chunk)."""

    header: SegmentHeader
    pending: PendingKV | None = None  # None: not wanted
    index: torch.Tensor | None = None  # its reserved blocks, as an index tensor
    dropped: bool = False  # counted (late) or failed already


class KVLanding:
    """Reservations of one decode node and the receiver that fills them."""

    def __init__(
        self,
        node_id: str,
        runner,
        store_host: str,
        store_port: int,
        stats: DecodeStats,
        transfer_timeout_s: float,
        verify_transfers: bool,
    ) -> None:
        self.stats = stats
        self.verify_transfers = verify_transfers
        self._runner = runner
        kv = runner.kv_cache
        self._layout = (kv.shape[1], (0, kv.shape[4]), kv_unit_bytes(kv))
        self._pending: dict[int, PendingKV] = {}
        self._reservation_ids = itertools.count(1)
        self.receiver = KVReceiver(
            node_id,
            store_host,
            store_port,
            runner.device,
            self,
            timeout_s=transfer_timeout_s,
            max_group_bytes=kv.numel() * kv.element_size(),
        )

    # ------------------------------------------------------- request path
    def open(self, request_id: str, reservation: Reservation, peer: str) -> tuple[int, int]:
        """Register a reservation; returns (reservation id, channel epoch)."""
        loop = asyncio.get_running_loop()
        reservation_id = next(self._reservation_ids)
        num_layers, heads, unit_bytes = self._layout
        coverage = Coverage(
            reservation.first_block, len(reservation.block_ids), num_layers, heads, unit_bytes
        )
        pending = PendingKV(request_id, reservation, peer, loop.create_future(), loop, coverage)
        self._pending[reservation_id] = pending
        return reservation_id, self.receiver.expect(peer, reservation_id)

    async def wait(self, reservation_id: int, timeout_s: float) -> None:
        """Until the KV landed (TimeoutError, TransferError otherwise)."""
        await asyncio.wait_for(self._pending[reservation_id].landed, timeout_s)

    def check(self, reservation_id: int, expected_digest: bytes) -> None:
        """With ``--verify-kv``: every chunk that landed must be what the prefill node sent."""
        if self.verify_transfers and chain(self._pending[reservation_id].digests) != (
            expected_digest
        ):
            self.stats.checksum_mismatches += 1
            raise TransferError("the KV that landed differs from what the prefill node sent")

    def expire(self, reservation_id: int) -> None:
        """The lease ran out: the reservation is reclaimed (its blocks are freed
        by the abort that follows); whatever arrives for it later is dropped."""
        pending = self._pending[reservation_id]
        with pending.lock:
            if pending.state in _OPEN + (TransferState.LANDED,):
                pending.state = TransferState.EXPIRED
                self.stats.leases_expired += 1

    def close(self, reservation_id: int) -> None:
        """The request path is done with this reservation, whatever happened."""
        pending = self._pending.pop(reservation_id)
        self.receiver.unexpect(pending.peer, reservation_id)
        with pending.lock:
            if pending.state in _OPEN + (TransferState.LANDED,):
                pending.state = TransferState.ABORTED

    def reset_peer(self, peer: str) -> None:
        """The prefill node is unreachable or stalled: rebuild its channel on next use."""
        self.receiver.reset(peer)

    # ------------------------------------------------------ engine thread
    def commit(
        self,
        engine: LLMEngine,
        reservation_id: int,
        first_token: int,
        first_logprobs: TokenLogprobs | None,
        cached_tokens: int,
    ) -> None:
        pending = self._pending[reservation_id]
        with pending.lock:
            if pending.state is not TransferState.LANDED:
                raise TransferError(f"reservation of {pending.request_id} is {pending.state.name}")
            if pending.landed_event is not None:
                torch.cuda.current_stream().wait_event(pending.landed_event)
            engine.commit_request(pending.request_id, first_token, first_logprobs, cached_tokens)
            pending.state = TransferState.COMMITTED

    def wait_for_landings(self, request_id: str) -> None:
        """On the engine thread, before an abort frees the request's blocks: a
        scatter may still be writing them."""
        for pending in list(self._pending.values()):
            if pending.request_id == request_id and pending.landed_event is not None:
                torch.cuda.current_stream().wait_event(pending.landed_event)

    # --------------------------------------------------- receiver thread
    def on_group(self, peer: str, headers: list[SegmentHeader]) -> list[_Segment]:
        return [self._announce(peer, h) for h in headers]

    def _announce(self, peer: str, header: SegmentHeader) -> _Segment:
        seg = _Segment(header)
        pending = self._pending.get(header.reservation_id)
        if pending is None or pending.peer != peer:
            if not header.is_end:
                self._drop(seg, late=True)
                logger.info("dropping KV for reservation %d, which is gone", header.reservation_id)
            return seg
        with pending.lock:
            if header.is_end:
                if pending.state in _OPEN:
                    self._fail(pending, "the prefill node ended the stream before all KV came")
                return seg
            if pending.state not in _OPEN:
                self._drop(seg, late=pending.state in _GONE)
                return seg
            if (error := pending.coverage.accept(header)) is not None:
                self._fail(pending, f"a KV segment for {pending.request_id} does not fit: {error}")
                seg.dropped = True
                return seg
            pending.state = TransferState.STREAMING
            blocks = pending.reservation.block_ids[header.block_start : header.block_end]
            seg.index = block_index(blocks, self._runner.device)
            seg.pending = pending
        return seg

    def on_chunk(self, peer: str, seg: _Segment, desc: ChunkDesc, data: torch.Tensor, stream):
        pending = seg.pending
        if pending is None or seg.dropped:
            return
        with pending.lock:
            if pending.state is not TransferState.STREAMING:
                self._drop(seg, late=pending.state in _GONE)
                return
            try:
                self._place(pending, seg.index, desc, data, stream)
            except Exception as e:
                self._fail(pending, f"could not place the KV of {pending.request_id}: {e}")
                seg.dropped = True
                return
            self.stats.bytes_received += data.numel()
            complete = pending.coverage.land(desc)
            if complete:
                pending.state = TransferState.LANDED
                self.stats.transfers_landed += 1
        if complete:
            pending.resolve()

    def _place(self, pending: PendingKV, index, desc: ChunkDesc, data, stream) -> None:
        runner = self._runner
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            runner.scatter_kv(index, data, desc.layers, desc.heads)
            if stream is not None:
                pending.landed_event = torch.cuda.Event()
                pending.landed_event.record(stream)
            if self.verify_transfers:
                pending.digests.append(checksum(runner.gather_kv(index, desc.layers, desc.heads)))

    def _drop(self, seg: _Segment, late: bool) -> None:
        if not seg.dropped:
            seg.dropped = True
            if late:
                self.stats.late_transfers += 1

    @staticmethod
    def _fail(pending: PendingKV, message: str) -> None:
        """Under the pending's lock."""
        pending.state = TransferState.FAILED
        pending.resolve(TransferError(message))

    def on_peer_failed(self, peer: str, error: Exception) -> None:
        for pending in list(self._pending.values()):
            with pending.lock:
                if pending.peer != peer or pending.state not in _OPEN:
                    continue
                pending.state = TransferState.FAILED
            self.stats.transfer_failures += 1
            pending.resolve(TransferError(f"KV channel from {peer} failed: {error}"))

    def close_receiver(self) -> None:
        self.receiver.close()


# Still waiting for KV; and gone (whatever arrives for those is late).
_OPEN = (TransferState.RESERVED, TransferState.STREAMING)
_GONE = (TransferState.ABORTED, TransferState.EXPIRED)
