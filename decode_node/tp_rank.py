"""Ranks 1..t-1 of a tensor-parallel decode node: each lands its own KV heads.

The engine builds ``DecodeRank`` in every rank's process but rank 0
(``worker_extension_cls``); rank 0's landing (decode_node/kv_landing.py)
reaches it through ``LLMEngine.call_workers``, in order with the steps:

- ``setup`` (once): this rank's KVReceiver, a client of rank 0's TCPStore,
  and its report connection to rank 0 (decode_node/rank_reports.py);
- ``kv_expect``: a reservation (its id, blocks, the prefill node, its size and
  the channel epoch); the receiver expects the prefill ranks that pair with
  this one (common/kv_transfer/pairing.py). Rank 0 sends the blocks to the
  prefill node without waiting for this hand-off, so a header may name a
  reservation this rank has not heard of yet: reservation ids are never
  reused, and every reservation's ``kv_expect`` comes before its end here, so
  an id neither announced nor recently ended is one whose ``kv_expect`` is on
  its way, and the receiver's thread waits for it (up to the transfer timeout)
  instead of dropping it;
- ``kv_commit``: the request joins the batch: the next step on this rank is
  ordered after the last scatter of its blocks;
- ``kv_close``: the reservation is over (committed, failed or aborted):
  whatever arrives for it later is dropped, and the next step is ordered after
  any scatter still queued, since rank 0 may hand the blocks to another request.

This rank's part landing or failing, and a pair channel breaking, are reported
to rank 0, which alone decides the request's fate.
"""

from __future__ import annotations

import threading
import time

from common.kv_transfer import KVReceiver, TransferError, TransferState
from common.kv_transfer.pairing import kv_pairs, receives_of
from common.kv_transfer.receiver import StaleEpoch
from decode_node.landing_core import OPEN, LandingCore, PendingKV
from decode_node.rank_reports import Report, ReportClient
from decode_node.stats import DecodeStats
from engine.llm_engine import Reservation


class DecodeRank(LandingCore):
    def __init__(self, runner) -> None:
        # This rank's counters are not published; rank 0 counts from the reports.
        super().__init__(runner, DecodeStats(), verify_transfers=False)
        self.rank = runner.tp.rank
        self.tp_size = runner.tp.size
        self.num_kv_heads = runner.layout.num_kv_heads
        self.receiver: KVReceiver | None = None
        self.reports: ReportClient | None = None
        self.timeout_s = 30.0
        # Reservations that ended here, with when: what arrives for them is late.
        # Kept for twice the transfer timeout (a sender lingers at most one).
        self._ended: dict[int, float] = {}
        self._announced = threading.Condition()

    # ------------------------------------------------------- rank 0's calls
    def setup(self, payload: dict) -> None:
        runner = self._runner
        kv = runner.kv_cache
        self.timeout_s = payload["timeout_s"]
        self.reports = ReportClient(payload["report_port"])
        self.receiver = KVReceiver(
            payload["node_id"],
            payload["store_host"],
            payload["store_port"],
            runner.device,
            self,
            timeout_s=self.timeout_s,
            max_group_bytes=kv.numel() * kv.element_size(),
            rank=self.rank,
            connect_timeout_s=payload["connect_timeout_s"],
            wait_s=payload["wait_s"],
        )

    def kv_expect(self, payload: dict) -> None:
        rid = payload["reservation_id"]
        reservation = Reservation(
            payload["request_id"],
            payload["block_ids"],
            payload["first_block"],
            payload["num_prompt_tokens"],
        )
        pending = PendingKV(
            reservation.request_id,
            reservation,
            payload["peer"],
            self._coverage(reservation),
            peer_tp=payload["peer_tp"],
            reservation_id=rid,
        )
        with self._announced:
            self._pending[rid] = pending
            self._announced.notify_all()
        try:
            for pair in self._senders(pending):
                self.receiver.expect(pending.peer, rid, pair.sender, payload["epoch"])
        except StaleEpoch as e:
            with pending.lock:
                pending.state = TransferState.FAILED
            self._report("failed", rid, message=str(e))

    def kv_commit(self, payload: dict) -> None:
        pending = self._end(payload["reservation_id"])
        if pending is not None:
            self._unexpect(payload["reservation_id"], pending)
            self.order_after_landing(pending)

    def kv_close(self, payload: dict) -> None:
        rid = payload["reservation_id"]
        pending = self._end(rid)
        if pending is None:
            return  # committed already
        self._unexpect(rid, pending)
        with pending.lock:  # a scatter in progress finishes first
            if pending.state in OPEN + (TransferState.LANDED,):
                pending.state = TransferState.ABORTED
        self.order_after_landing(pending)

    def _end(self, rid: int) -> PendingKV | None:
        now = time.monotonic()
        with self._announced:
            self._ended[rid] = now
            for old, at in list(self._ended.items()):
                if now - at <= 2 * self.timeout_s:
                    break  # insertion order: the rest are newer
                del self._ended[old]
            return self._pending.pop(rid, None)

    # ---------------------------------------------------- the landing's news
    def _lookup(self, reservation_id: int) -> PendingKV | None:
        with self._announced:
            self._announced.wait_for(
                lambda: reservation_id in self._pending or reservation_id in self._ended,
                timeout=self.timeout_s,
            )
            return self._pending.get(reservation_id)

    def _landed(self, pending: PendingKV) -> None:
        rid = pending.reservation_id
        num_bytes = (
            (len(pending.reservation.block_ids) - pending.reservation.first_block)
            * self._layout[0]
            * (self._layout[1][1] - self._layout[1][0])
            * self._layout[2]
        )
        self._report("landed", rid, num_bytes=num_bytes)

    def _failed(self, pending: PendingKV, error: TransferError) -> None:
        self._report("failed", pending.reservation_id, message=str(error))

    def _late(self) -> None:
        self._report("late", 0)

    def on_peer_failed(self, peer: str, error: Exception, epoch: int) -> None:
        self.reports.send(
            Report("peer_failed", self.rank, peer=peer, epoch=epoch, message=str(error))
        )
        self.fail_peer(peer, error)

    # ---------------------------------------------------------------- misc
    def _senders(self, pending: PendingKV):
        pairs = kv_pairs(self.num_kv_heads, pending.peer_tp, self.tp_size)
        return receives_of(pairs, self.rank)

    def _unexpect(self, rid: int, pending: PendingKV) -> None:
        for pair in self._senders(pending):
            self.receiver.unexpect(pending.peer, rid, pair.sender)

    def _report(self, kind: str, rid: int, num_bytes: int = 0, message: str = "") -> None:
        self.reports.send(Report(kind, self.rank, rid, num_bytes, message=message))
