"""One request's KV transfer as the prefill node sees it: where it goes
(``Destination``), its state shared by the threads that handle it
(``TransferTicket``) and what it cost (``TransferReport``); the segments it is
queued as (``OutgoingSegment``)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from common.kv_transfer.checksum import chain
from common.kv_transfer.protocol import SegmentHeader, TransferState


@dataclass(slots=True, frozen=True)
class Destination:
    node_id: str  # the decode node
    store_host: str  # its TCPStore
    store_port: int
    epoch: int  # the channel incarnation it expects
    tensor_parallel_size: int = 1  # its ranks (each receives its own KV heads)
    # What its cache stores where not the model's dtype ("fp8_e4m3"; "": the model's).
    kv_cache_dtype: str = ""


@dataclass(slots=True, frozen=True)
class TransferReport:
    num_bytes: int
    wire_s: float  # time its chunks spent on the wire, summed
    exposed_s: float  # from its last chunk's layers being done to that chunk being out
    digest: bytes  # chained chunk checksums (--verify-kv), else empty


class TransferTicket:
    """One request's KV transfer from one rank of the prefill node, shared by the
    engine thread (which queues its segments), its links' threads (which send
    them and keep the counts) and the request's handler (which awaits ``done``).
    ``parts``: the decode node's ranks this rank sends to; it is done when the
    last chunk to each is out."""

    def __init__(
        self, request_id: str, dest: Destination, deadline: float, verify: bool, parts: int = 1
    ) -> None:
        self.request_id = request_id
        self.dest = dest
        self.deadline = deadline
        self.verify = verify
        self.done: Future[TransferReport] = Future()
        self.state = TransferState.SENDING
        self.num_bytes = 0
        self.wire_s = 0.0
        self.digests: list[bytes] = []
        self.parts_left = parts
        self.exposed_s = 0.0
        self._lock = threading.Lock()  # parts are sent by several links' threads

    @property
    def alive(self) -> bool:
        return not self.done.done()

    def cancel(self) -> None:
        if self.done.cancel():
            self.state = TransferState.ABORTED

    def fail(self, error: Exception) -> None:
        try:
            self.done.set_exception(error)
            self.state = TransferState.FAILED
        except InvalidStateError:
            pass  # settled already

    def sent(self, num_bytes: int, wire_s: float, last: bool, exposed_s: float) -> None:
        """A chunk is out (a link's thread); ``last``: its part's last chunk."""
        with self._lock:
            self.num_bytes += num_bytes
            self.wire_s += wire_s
            if not last:
                return
            self.exposed_s = max(self.exposed_s, exposed_s)
            self.parts_left -= 1
            if self.parts_left > 0:
                return
        self._succeed()

    def _succeed(self) -> None:
        digest = chain(self.digests) if self.verify else b""
        try:
            report = TransferReport(self.num_bytes, self.wire_s, self.exposed_s, digest)
            self.done.set_result(report)
            self.state = TransferState.SENT
        except InvalidStateError:
            pass


@dataclass(slots=True)
class OutgoingSegment:
    header: SegmentHeader
    ticket: TransferTicket | None  # None for an end header
    final: bool = False  # the request's last segment (its prompt's last step)


def number_group(segments: list[OutgoingSegment]) -> None:
    """Number a group's headers in place (protocol.py: the first says how many)."""
    for i, s in enumerate(segments):
        s.header = s.header.with_group(len(segments), i)
