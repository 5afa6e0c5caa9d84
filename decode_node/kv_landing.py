"""The decode node's KV landing: reservations filled chunk by chunk as a prefill node streams.

Life cycle of one reservation (``TransferState``):

1. RESERVED -- ``open`` registers the engine's reservation under the id the
   router gave it (a router never reuses one: the id is the blocks'
   generation) and tells the receiver to expect that prefill node's stream,
   from each of its ranks that pairs with this one
   (common/kv_transfer/pairing.py); the request path then sends the blocks and
   the channel epoch to the prefill node (decode_node/remote_prefill.py).
2. STREAMING -- the receiver read a segment header naming it (``on_group``,
   the receiver's thread; decode_node/landing_core.py). Each chunk is
   scattered into the reserved blocks as it lands, while the later chunks are
   on the wire.
3. LANDED -- the last unit (block x layer x head) landed, on this rank and,
   with tensor parallelism, on every other rank (each reports its own part,
   decode_node/rank_reports.py): the request path's ``landed`` future resolves.
4. COMMITTED -- ``commit`` runs under the engine's lock (inline on the
   request path's loop when the engine thread is idle, else on that thread:
   engine/engine_thread.py): it orders the engine's stream after the last
   scatter (on every rank) and makes the request join the running batch with
   the prefill node's first token, which came on the channel behind the KV.
Or EXPIRED (the lease ran out first: ``expire``), FAILED (the channel from that
peer failed, a segment did not fit, a scatter failed, the prefill node ended
the stream early, or another rank's part failed) or ABORTED (the request ended
first; ``close`` marks whatever is still open, on every rank). In each of those
cases the request path aborts the engine request, which frees the blocks --
after the last scatter that was queued (``wait_for_landings``; the other ranks
order themselves the same way when ``close`` reaches them, before any later
step). Whatever arrives for a reservation that is no longer RESERVED or
STREAMING is dropped, never written, and counted as late once per segment.

Tensor parallelism: rank 0 hosts the TCPStore and owns the channel epochs; the
other ranks (decode_node/tp_rank.py) learn each reservation (``kv_expect``),
its end (``kv_close``) and its commit (``kv_commit``) from rank 0 through
``LLMEngine.call_workers``, in order with the engine's steps.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from common.kv_transfer import KVReceiver, TransferError, TransferState
from common.kv_transfer.checksum import chain
from common.kv_transfer.pairing import kv_pairs, receives_of
from decode_node.landing_core import OPEN, LandingCore, PendingKV
from decode_node.rank_reports import Report, ReportListener
from decode_node.stats import DecodeStats
from engine.layers.attention.kv_quant import quantized_name
from engine.llm_engine import LLMEngine, Reservation

if TYPE_CHECKING:
    from engine.engine_thread import EngineThread
    from engine.sequence import TokenLogprobs

logger = logging.getLogger(__name__)


class KVLanding(LandingCore):
    """Reservations of one decode node and the receiver that fills them (rank 0)."""

    def __init__(
        self,
        node_id: str,
        runner,
        store_host: str,
        store_port: int,
        stats: DecodeStats,
        transfer_timeout_s: float,
        verify_transfers: bool,
        engine: EngineThread | None = None,
        connect_timeout_s: float = 5.0,
        wait_s: float | None = None,
    ) -> None:
        super().__init__(runner, stats, verify_transfers)
        self.tp_size = runner.tp.size
        self.num_kv_heads = runner.layout.num_kv_heads
        # Told to prefill nodes with its blocks (KVChannel.kv_cache_dtype).
        self.kv_cache_dtype = quantized_name(runner.kv_cache.dtype)
        self._engine = engine  # to reach the other ranks (tensor parallelism)
        kv = runner.kv_cache
        self.receiver = KVReceiver(
            node_id,
            store_host,
            store_port,
            runner.device,
            self,
            timeout_s=transfer_timeout_s,
            max_group_bytes=kv.numel() * kv.element_size(),
            connect_timeout_s=connect_timeout_s,
            wait_s=wait_s,
        )
        self.reports: ReportListener | None = None
        if self.tp_size > 1:
            if engine is None:
                raise ValueError("a tensor-parallel decode node's landing needs its engine")
            self.reports = ReportListener(self._on_report)
            setup = {
                "node_id": node_id,
                "store_host": store_host,
                "store_port": store_port,
                "timeout_s": transfer_timeout_s,
                "connect_timeout_s": connect_timeout_s,
                "wait_s": self.receiver.wait_s,
                "report_port": self.reports.port,
            }
            engine.call(lambda e: e.call_workers("setup", setup)).result()

    # ------------------------------------------------------- request path
    def open(
        self,
        request_id: str,
        reservation: Reservation,
        peer: str,
        peer_tp: int,
        reservation_id: int,
    ) -> int:
        """Register a reservation under the router's id and expect its stream
        from ``peer``; returns the channel epoch its blocks name (ValueError for
        an id that is not an int64 above 0 or is in use here)."""
        if not 0 < reservation_id < 1 << 63:
            raise ValueError(f"a reservation id is an int64 above 0; got {reservation_id}")
        if reservation_id in self._pending:
            raise ValueError(f"reservation id {reservation_id} is in use on this node")
        loop = asyncio.get_running_loop()
        landed = loop.create_future()
        # Retrieved even where the request path is gone when its failure comes
        # (a channel failure resolves it a loop turn later): no warning at exit.
        landed.add_done_callback(lambda f: f.cancelled() or f.exception())
        peer_tp = max(1, peer_tp)
        pending = PendingKV(
            request_id,
            reservation,
            peer,
            self._coverage(reservation),
            peer_tp=peer_tp,
            reservation_id=reservation_id,
            landed=landed,
            loop=loop,
            ranks_left=self.tp_size - 1,
            first_token=loop.create_future(),
            end_digest=loop.create_future() if self.verify_transfers else None,
        )
        self._pending[reservation_id] = pending
        epoch = self.receiver.epoch_of(peer)
        for pair in receives_of(kv_pairs(self.num_kv_heads, peer_tp, self.tp_size), 0):
            self.receiver.expect(peer, reservation_id, pair.sender, epoch)
        if self.tp_size > 1:
            expect = {
                "reservation_id": reservation_id,
                "request_id": request_id,
                "peer": peer,
                "peer_tp": peer_tp,
                "epoch": epoch,
                "block_ids": reservation.block_ids,
                "first_block": reservation.first_block,
                "num_prompt_tokens": reservation.num_prompt_tokens,
            }
            self._call_workers("kv_expect", expect)
        return epoch

    async def wait(self, reservation_id: int, timeout_s: float) -> None:
        """Until the KV landed (TimeoutError, TransferError otherwise)."""
        await asyncio.wait_for(self._pending[reservation_id].landed, timeout_s)

    def first_token(self, reservation_id: int) -> asyncio.Future:
        """The prompt's first token (protocol.FirstToken) once it landed behind
        the KV; None if none will come (the channel failed)."""
        return self._pending[reservation_id].first_token

    async def check(self, reservation_id: int, timeout_s: float) -> None:
        """With ``--verify-kv``: every chunk that landed must be what the prefill
        node sent, by the checksum its end header carries (TransferError otherwise)."""
        pending = self._pending[reservation_id]
        if pending.end_digest is None:
            return
        try:  # the end header follows the token
            digest = await asyncio.wait_for(asyncio.shield(pending.end_digest), timeout_s)
        except TimeoutError:
            raise TransferError("the prefill node's end header never came") from None
        if chain(pending.digests) != digest:
            self.stats.checksum_mismatches += 1
            raise TransferError("the KV that landed differs from what the prefill node sent")

    def expire(self, reservation_id: int) -> None:
        """The lease ran out: the reservation is reclaimed (its blocks are freed
        by the abort that follows); whatever arrives for it later is dropped."""
        pending = self._pending.get(reservation_id)
        if pending is None:
            return
        with pending.lock:
            if pending.state in OPEN + (TransferState.LANDED,):
                pending.state = TransferState.EXPIRED
                self.stats.leases_expired += 1

    def close(self, reservation_id: int) -> None:
        """The request path is done with this reservation, whatever happened."""
        pending = self._pending.pop(reservation_id, None)
        if pending is None:
            return
        self._unexpect(pending.peer, pending.peer_tp, reservation_id)
        with pending.lock:
            if pending.state in OPEN + (TransferState.LANDED,):
                pending.state = TransferState.ABORTED
        if self.tp_size > 1:
            self._call_workers("kv_close", {"reservation_id": reservation_id})

    def _unexpect(self, peer: str, peer_tp: int, reservation_id: int) -> None:
        for pair in receives_of(kv_pairs(self.num_kv_heads, peer_tp, self.tp_size), 0):
            self.receiver.unexpect(peer, reservation_id, pair.sender)

    def reset_peer(self, peer: str) -> None:
        """The prefill node is unreachable or stalled: rebuild its channels on next use."""
        self.receiver.reset(peer)

    # ------------------------------------------ under the engine's lock
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
            self.order_after_landing(pending)
            # The other ranks order their next step after their own scatters.
            engine.call_workers("kv_commit", {"reservation_id": reservation_id})
            engine.commit_request(pending.request_id, first_token, first_logprobs, cached_tokens)
            pending.state = TransferState.COMMITTED

    def wait_for_landings(self, request_id: str) -> None:
        """On the engine thread, before an abort frees the request's blocks: a
        scatter may still be writing them."""
        for pending in list(self._pending.values()):
            if pending.request_id == request_id:
                self.order_after_landing(pending)

    # --------------------------------------------- this rank and the others
    def _landed(self, pending: PendingKV) -> None:
        """This rank's part landed, or another rank reported its own."""
        with pending.lock:
            if pending.state is not TransferState.LANDED or pending.coverage.units_left:
                return
            if pending.ranks_left:
                return
        self.stats.transfers_landed += 1
        pending.resolve()

    def _failed(self, pending: PendingKV, error: TransferError) -> None:
        pending.resolve(error)

    def on_peer_failed(self, peer: str, error: Exception, epoch: int) -> None:
        self.fail_peer(peer, error)

    def _on_report(self, report: Report) -> None:
        """Another rank's news (its report thread)."""
        if report.kind == "late":
            self.stats.late_transfers += 1
            return
        if report.kind == "peer_failed":
            self.receiver.fail_epoch(report.peer, report.epoch)
            self.fail_peer(report.peer, TransferError(report.message))
            return
        pending = self._pending.get(report.reservation_id)
        if pending is None:
            return  # closed meanwhile
        if report.kind == "landed":
            self.stats.bytes_received += report.num_bytes
            with pending.lock:
                pending.ranks_left -= 1
            self._landed(pending)
        elif report.kind == "failed":
            with pending.lock:
                if pending.state not in OPEN + (TransferState.LANDED,):
                    return
                pending.state = TransferState.FAILED
            self._failed(pending, TransferError(f"rank {report.rank}: {report.message}"))

    def _call_workers(self, method: str, payload: dict) -> None:
        """From the request path: on the engine thread, in order with its steps."""
        self._engine.call(lambda e: e.call_workers(method, payload))

    def close_receiver(self) -> None:
        self.receiver.close()
        if self.reports is not None:
            self.reports.close()
