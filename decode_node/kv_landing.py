"""The decode node's KV landing: reservations waiting for a prefill node's KV.

Life cycle of one reservation (``TransferState``):

1. RESERVED -- ``open`` registers the engine's reservation under a fresh id
   (ids are never reused: the id is the blocks' generation) and tells the
   receiver to expect a transfer from that prefill node; the request path sends
   the id, the channel epoch and the first missing block in its ``Prefill``.
2. LANDED -- the receiver thread calls ``_on_transfer`` with the header and
   payload. If the reservation is still RESERVED and the sizes match, the
   payload is scattered into its blocks (on the receiver's CUDA stream, with an
   event recorded after it) and the request path's ``landed`` future resolves.
   A transfer for a reservation that is gone is dropped, never written, and
   counted as late.
3. COMMITTED -- ``commit`` runs on the engine thread: it orders the engine's
   stream after the landing and makes the request join the running batch with
   the prefill node's first token.
Or EXPIRED (the lease ran out before the KV landed: ``expire``), FAILED (the
channel from that peer failed, or the payload did not fit) or ABORTED (the
request ended first; ``close`` marks whatever is still open). In each of those
cases the request path aborts the engine request, which frees the blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer import KVReceiver, TransferError, TransferHeader, TransferState
from common.kv_transfer.checksum import checksum
from decode_node.stats import DecodeStats
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
    state: TransferState = TransferState.RESERVED
    landed_event: torch.cuda.Event | None = None
    digest: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def resolve(self, error: BaseException | None = None) -> None:
        def done() -> None:
            if not self.landed.done():
                if error is None:
                    self.landed.set_result(None)
                else:
                    self.landed.set_exception(error)

        self.loop.call_soon_threadsafe(done)


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
        self._pending: dict[int, PendingKV] = {}
        self._reservation_ids = itertools.count(1)
        self.receiver = KVReceiver(
            node_id,
            store_host,
            store_port,
            runner.device,
            on_transfer=self._on_transfer,
            on_peer_failed=self._on_peer_failed,
            timeout_s=transfer_timeout_s,
        )

    # ------------------------------------------------------- request path
    def open(self, request_id: str, reservation: Reservation, peer: str) -> tuple[int, int]:
        """Register a reservation; returns (reservation id, channel epoch)."""
        loop = asyncio.get_running_loop()
        reservation_id = next(self._reservation_ids)
        pending = PendingKV(request_id, reservation, peer, loop.create_future(), loop)
        self._pending[reservation_id] = pending
        return reservation_id, self.receiver.expect(peer, reservation_id)

    async def wait(self, reservation_id: int, timeout_s: float) -> None:
        """Until the KV landed (TimeoutError, TransferError otherwise)."""
        await asyncio.wait_for(self._pending[reservation_id].landed, timeout_s)

    def check(self, reservation_id: int, expected_digest: bytes) -> None:
        """With ``--verify-kv``: the landed blocks must be what the prefill node sent."""
        if self.verify_transfers and self._pending[reservation_id].digest != expected_digest:
            self.stats.checksum_mismatches += 1
            raise TransferError("the KV that landed differs from what the prefill node sent")

    def expire(self, reservation_id: int) -> None:
        """The lease ran out: the reservation is reclaimed (its blocks are freed
        by the abort that follows); a transfer arriving later is dropped."""
        pending = self._pending[reservation_id]
        with pending.lock:
            if pending.state in (TransferState.RESERVED, TransferState.LANDED):
                pending.state = TransferState.EXPIRED
                self.stats.leases_expired += 1

    def close(self, reservation_id: int) -> None:
        """The request path is done with this reservation, whatever happened."""
        pending = self._pending.pop(reservation_id)
        self.receiver.unexpect(pending.peer, reservation_id)
        with pending.lock:
            if pending.state in (TransferState.RESERVED, TransferState.LANDED):
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
        landing may still be writing them."""
        for pending in list(self._pending.values()):
            if pending.request_id == request_id and pending.landed_event is not None:
                torch.cuda.current_stream().wait_event(pending.landed_event)

    # --------------------------------------------------- receiver thread
    def _on_transfer(
        self, peer: str, header: TransferHeader, payload: torch.Tensor, stream
    ) -> None:
        pending = self._pending.get(header.reservation_id)
        if pending is None:
            self.stats.late_transfers += 1
            logger.info(
                "dropped a KV transfer for reservation %d, which is gone", header.reservation_id
            )
            return
        with pending.lock:
            if pending.state is not TransferState.RESERVED:
                self.stats.late_transfers += 1
                return
            blocks = pending.reservation.blocks_to_fill
            expected = len(blocks) * self._runner.kv_block_bytes
            if header.num_blocks != len(blocks) or header.num_bytes != expected:
                pending.state = TransferState.FAILED
                pending.resolve(
                    TransferError(
                        f"transfer for {pending.request_id} has {header.num_blocks} blocks / "
                        f"{header.num_bytes} bytes, the reservation needs {len(blocks)} / {expected}"
                    )
                )
                return
            try:
                self._place(pending, blocks, payload, stream)
            except Exception as e:
                pending.state = TransferState.FAILED
                pending.resolve(
                    TransferError(f"could not place the KV of {pending.request_id}: {e}")
                )
                return
            pending.state = TransferState.LANDED
            self.stats.transfers_landed += 1
            self.stats.bytes_received += header.num_bytes
        pending.resolve()

    def _place(self, pending: PendingKV, blocks: list[int], payload: torch.Tensor, stream) -> None:
        runner = self._runner
        if stream is not None:
            with torch.cuda.stream(stream):
                if blocks:
                    runner.scatter_kv(blocks, payload)
                pending.landed_event = torch.cuda.Event()
                pending.landed_event.record(stream)
        elif blocks:
            runner.scatter_kv(blocks, payload)
        if self.verify_transfers:
            landed = runner.gather_kv(blocks) if blocks else torch.empty(0, dtype=runner.dtype)
            pending.digest = checksum(landed)

    def _on_peer_failed(self, peer: str, error: Exception) -> None:
        for pending in list(self._pending.values()):
            with pending.lock:
                if pending.peer != peer or pending.state is not TransferState.RESERVED:
                    continue
                pending.state = TransferState.FAILED
            self.stats.transfer_failures += 1
            pending.resolve(TransferError(f"KV channel from {peer} failed: {error}"))

    def close_receiver(self) -> None:
        self.receiver.close()
