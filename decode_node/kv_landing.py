"""The decode node's KV landing: reservations filled chunk by chunk as a prefill node streams.

Life cycle of one reservation (``TransferState``):

1. RESERVED -- ``open`` registers the engine's reservation under a fresh id
   (ids are never reused: the id is the blocks' generation) and tells the
   receiver to expect that prefill node's stream, from each of its ranks that
   pairs with this one (common/kv_transfer/pairing.py); the request path sends
   the id, the channel epoch and the first missing block in its ``Prefill``.
   Or, at tensor-parallel size 1, the Prefill goes first: ``expect`` takes the
   id and tells the receiver before the engine reserves, ``open`` then
   registers the reservation under that id, and the request path sends its
   first missing block and size after the Prefill (PrefillRequest.blocks_follow).
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
   the prefill node's first token.
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
import itertools
import logging
from typing import TYPE_CHECKING

from common.kv_transfer import KVReceiver, TransferError, TransferState
from common.kv_transfer.checksum import chain
from common.kv_transfer.pairing import kv_pairs, receives_of
from common.wire import FIRST_ROUTER_RESERVATION_ID
from decode_node.landing_core import OPEN, LandingCore, PendingKV
from decode_node.rank_reports import Report, ReportListener
from decode_node.stats import DecodeStats
from engine.llm_engine import LLMEngine, Reservation

if TYPE_CHECKING:
    from engine.engine_thread import EngineThread
    from engine.sequence import TokenLogprobs
    from proto import internal_pb2

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
    ) -> None:
        super().__init__(runner, stats, verify_transfers)
        self.tp_size = runner.tp.size
        self.num_kv_heads = runner.layout.num_kv_heads
        self._engine = engine  # to reach the other ranks (tensor parallelism)
        self._reservation_ids = itertools.count(1)
        # Ids ``expect`` gave out that ``open`` has not taken yet: (peer, its size, epoch).
        self._expected: dict[int, tuple[str, int, int]] = {}
        # Prefill node -> its session frames KV headers as a block (``frames_blocks``).
        self._frames_blocks: dict[str, bool] = {}
        kv = runner.kv_cache
        self.receiver = KVReceiver(
            node_id,
            store_host,
            store_port,
            runner.device,
            self,
            timeout_s=transfer_timeout_s,
            max_group_bytes=kv.numel() * kv.element_size(),
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
                "report_port": self.reports.port,
            }
            engine.call(lambda e: e.call_workers("setup", setup)).result()

    # ------------------------------------------------------- request path
    def expect(
        self, peer: str, peer_tp: int = 1, reservation_id: int | None = None
    ) -> tuple[int, int]:
        """A transfer from ``peer`` whose blocks are not reserved yet (``open``
        registers them under the id); returns (reservation id, channel epoch).
        The receiver reads the peer's stream for it from now on: the prefill node
        ends it with an end header even when no blocks ever come (``close``).
        ``reservation_id``: a router's, for a Prefill it sent itself (from
        FIRST_ROUTER_RESERVATION_ID up, so never one of this node's own)."""
        if self.tp_size > 1:
            raise ValueError("the other ranks learn a reservation with its blocks: open() it")
        if reservation_id is None:
            reservation_id = next(self._reservation_ids)
        elif not FIRST_ROUTER_RESERVATION_ID <= reservation_id < 1 << 63:
            raise ValueError(
                f"a router's reservation id is from {FIRST_ROUTER_RESERVATION_ID} up, "
                f"under 2**63; got {reservation_id}"
            )
        elif reservation_id in self._expected or reservation_id in self._pending:
            raise ValueError(f"reservation id {reservation_id} is in use")
        peer_tp = max(1, peer_tp)
        epoch = self._expect(peer, peer_tp, reservation_id)
        self._expected[reservation_id] = (peer, peer_tp, epoch)
        return reservation_id, epoch

    def _expect(self, peer: str, peer_tp: int, reservation_id: int) -> int:
        epoch = self.receiver.epoch_of(peer)
        pairs = kv_pairs(self.num_kv_heads, peer_tp, self.tp_size)
        block = self._frames_blocks.get(peer, False)
        for pair in receives_of(pairs, 0):
            self.receiver.expect(peer, reservation_id, pair.sender, epoch, block)
        return epoch

    def frames_blocks(self, peer: str, header_block: bool) -> None:
        """What ``peer``'s open session said of the KV headers' framing
        (``PrefillSessionBatch.header_block``): the framing of the next channel
        epoch with it, fixed by that epoch's first expected reservation."""
        self._frames_blocks[peer] = header_block

    def name_channel(self, destination: internal_pb2.KVDestination, peer: str, epoch: int) -> None:
        """A Prefill's destination names its channel: the epoch, and how its
        headers are framed there (the prefill node frames them so)."""
        destination.channel_epoch = epoch
        destination.header_block = self.receiver.header_block_of(peer, epoch)

    def open(
        self,
        request_id: str,
        reservation: Reservation,
        peer: str,
        peer_tp: int = 1,
        reservation_id: int | None = None,
        first_token: bool = False,
    ) -> tuple[int, int]:
        """Register a reservation; returns (reservation id, channel epoch).
        ``reservation_id``: the one ``expect`` gave for it (TransferError, the
        id closed, when its channel failed since). ``first_token``: its Prefill
        asks for the first token on the channel (``first_token``)."""
        loop = asyncio.get_running_loop()
        expected = None
        if reservation_id is None:
            reservation_id = next(self._reservation_ids)
        else:
            expected = self._expected.pop(reservation_id)
            if self.receiver.epoch_of(peer) != expected[2]:
                # Nothing comes on that epoch any more (its channel failed).
                self._unexpect(peer, expected[1], reservation_id)
                raise TransferError(f"the KV channel from {peer} failed since the Prefill went")
        landed = loop.create_future()
        # Retrieved even where the request path is gone when its failure comes
        # (a channel failure resolves it a loop turn later): no warning at exit.
        landed.add_done_callback(lambda f: f.cancelled() or f.exception())
        pending = PendingKV(
            request_id,
            reservation,
            peer,
            self._coverage(reservation),
            peer_tp=max(1, peer_tp),
            reservation_id=reservation_id,
            landed=landed,
            loop=loop,
            ranks_left=self.tp_size - 1,
            first_token=loop.create_future() if first_token else None,
        )
        self._pending[reservation_id] = pending
        if expected is not None:
            return reservation_id, expected[2]
        epoch = self._expect(peer, max(1, peer_tp), reservation_id)
        if self.tp_size > 1:
            expect = {
                "reservation_id": reservation_id,
                "request_id": request_id,
                "peer": peer,
                "peer_tp": max(1, peer_tp),
                "epoch": epoch,
                # Rank 0's framing for the epoch: every rank's channels read it alike.
                "header_block": self.receiver.header_block_of(peer, epoch),
                "block_ids": reservation.block_ids,
                "first_block": reservation.first_block,
                "num_prompt_tokens": reservation.num_prompt_tokens,
            }
            self._call_workers("kv_expect", expect)
        return reservation_id, epoch

    async def wait(self, reservation_id: int, timeout_s: float) -> None:
        """Until the KV landed (TimeoutError, TransferError otherwise)."""
        await asyncio.wait_for(self._pending[reservation_id].landed, timeout_s)

    def first_token(self, reservation_id: int) -> asyncio.Future | None:
        """(first token, cached prompt tokens) once they landed behind the KV,
        where the Prefill asked for them (None: the prefill node had none). It
        may never come (an older release, a tensor-parallel prefill node): the
        reply brings them then. None too for an id whose Prefill failed before
        its blocks were reserved (never opened): its reply's error is raised."""
        pending = self._pending.get(reservation_id)
        return pending.first_token if pending is not None else None

    async def check_token(
        self, reservation_id: int, token_id: int, cached_tokens: int, timeout_s: float
    ) -> None:
        """With ``--verify-kv``, once the KV landed and the reply came: the first
        token on the channel and its cache hit, if one was announced, must be
        the reply's (TransferError otherwise)."""
        pending = self._pending[reservation_id]
        if pending.first_token is None or not pending.token_announced:
            return
        try:  # it lands right behind the KV
            came = await asyncio.wait_for(asyncio.shield(pending.first_token), timeout_s)
        except TimeoutError:
            raise TransferError("the first token announced on the KV channel never came") from None
        if came is not None and came != (token_id, cached_tokens):
            self.stats.checksum_mismatches += 1
            raise TransferError(
                f"the first token and cache hit on the KV channel {came} are not the "
                f"reply's {(token_id, cached_tokens)}"
            )

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
        pending = self._pending.get(reservation_id)
        if pending is None:
            return  # an id ``expect`` gave whose blocks were never reserved
        with pending.lock:
            if pending.state in OPEN + (TransferState.LANDED,):
                pending.state = TransferState.EXPIRED
                self.stats.leases_expired += 1

    def close(self, reservation_id: int) -> None:
        """The request path is done with this reservation (or an id ``expect``
        gave that was never opened), whatever happened."""
        pending = self._pending.pop(reservation_id, None)
        if pending is None:
            expected = self._expected.pop(reservation_id, None)
            if expected is not None:  # else ``open`` closed it already
                self._unexpect(expected[0], expected[1], reservation_id)
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
