"""Decode-node side: hosts the TCPStore; one receiving thread per prefill node.

A peer's thread keeps a header receive posted while any reservation of that
peer is awaited: from ``expect`` until the reservation's end header arrives
(after ``unexpect`` too, for at most the transfer timeout, so that segments the
prefill node sent before it learnt of a cancellation are read and dropped
rather than left blocking its channel). For each group it reads the k headers,
hands them to the sink (``on_group``), posts every chunk's receive at once into
one buffer -- sizes and order follow from the headers (protocol.wire_order) --
and hands each chunk to the sink (``on_chunk``) as soon as it landed, while the
later ones are still on the wire. A failure or a passed deadline closes the
channel, bumps the peer's epoch (the next transfer rebuilds the group) and
reports the peer (``on_peer_failed``) so that waiting reservations fail fast.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from common.kv_transfer.channel import RECEIVER, PairChannel, TransferError
from common.kv_transfer.protocol import ChunkDesc, SegmentHeader, wire_order

logger = logging.getLogger(__name__)


class KVSink(Protocol):
    """Where received KV goes (the decode node's landing; tests' collectors)."""

    def on_group(self, peer: str, headers: list[SegmentHeader]) -> list[object]:
        """One context per header, handed back with each of its chunks."""
        ...

    def on_chunk(
        self,
        peer: str,
        segment: object,
        desc: ChunkDesc,
        data: torch.Tensor,
        stream: torch.cuda.Stream | None,
    ) -> None: ...

    def on_peer_failed(self, peer: str, error: Exception) -> None: ...


@dataclass(slots=True)
class _Peer:
    node_id: str
    epoch: int
    # Reservation id -> None while its request waits for it, or the time until
    # which it lingers after the request gave up (its end header not yet seen).
    # A dict, not a count: each reservation ends on its own header.
    awaiting: dict[int, float | None] = field(default_factory=dict)
    receiving: bool = False  # a receive is posted on the channel
    channel: PairChannel | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None
    buffer: torch.Tensor | None = None  # receive buffer (KVReceiver._buffer)

    def wants_data(self) -> bool:
        now = time.monotonic()
        for rid, until in list(self.awaiting.items()):
            if until is not None and until < now:
                del self.awaiting[rid]  # its end never came (the Prefill never ran)
        return bool(self.awaiting)


class KVReceiver:
    def __init__(
        self,
        node_id: str,
        host: str,
        port: int,
        device: torch.device,
        sink: KVSink,
        timeout_s: float = 30.0,
        first_epoch: int | None = None,
        max_group_bytes: int = 1 << 40,
    ) -> None:
        self.node_id = node_id
        # Epochs start at a random point: a restarted decode node must not name
        # an epoch (a rendezvous key) a sender still holds from the previous
        # process. Benchmarks and tests pin it.
        self._first_epoch = first_epoch
        self.host = host
        self.port = port
        self.device = device
        self.timeout_s = timeout_s
        self.sink = sink
        # A group can never be larger than what the node could land (its cache).
        self.max_group_bytes = max_group_bytes
        self.store = dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def expect(self, peer_id: str, reservation_id: int) -> int:
        """A transfer for ``reservation_id`` will come from ``peer_id``; returns
        the epoch it must use."""
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None:
                first = self._first_epoch
                peer = self._peers[peer_id] = _Peer(
                    peer_id, secrets.randbits(48) if first is None else first
                )
                peer.thread = threading.Thread(
                    target=self._run, args=(peer,), name=f"kv-recv-{peer_id}", daemon=True
                )
                peer.thread.start()
        with peer.cond:
            peer.awaiting[reservation_id] = None
            peer.cond.notify()
            return peer.epoch

    def unexpect(self, peer_id: str, reservation_id: int) -> None:
        """The request no longer wants this transfer: keep reading (and dropping)
        what the peer sends for it until its end header, for at most the timeout."""
        peer = self._peers.get(peer_id)
        if peer is not None:
            with peer.cond:
                if reservation_id in peer.awaiting:
                    peer.awaiting[reservation_id] = time.monotonic() + self.timeout_s

    def reset(self, peer_id: str) -> None:
        """The peer failed or restarted (its Prefill call broke): when no receive
        is in progress, drop the channel so that the next transfer rendezvouses anew
        under a new epoch instead of posting a receive to a dead process."""
        peer = self._peers.get(peer_id)
        if peer is None:
            return
        with peer.cond:
            if not peer.receiving and peer.channel is not None:
                peer.channel.close()
                peer.channel = None
                peer.epoch += 1
                for rid, until in list(peer.awaiting.items()):
                    if until is not None:  # lingering on the old channel: moot now
                        del peer.awaiting[rid]

    def _run(self, peer: _Peer) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        while not self._closed:
            with peer.cond:
                while not peer.wants_data() and not self._closed:
                    peer.cond.wait(timeout=0.5)
                if self._closed:
                    return
                epoch = peer.epoch
                peer.receiving = True
            try:
                if peer.channel is None or peer.channel.closed:
                    peer.channel = PairChannel(
                        self.store,
                        f"pair/{peer.node_id}/{epoch}",
                        RECEIVER,
                        self.device,
                        self.timeout_s,
                    )
                with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
                    self._receive_group(peer, peer.channel)
            except Exception as e:
                with peer.cond:
                    peer.receiving = False
                    if peer.channel is not None:
                        peer.channel.close()
                    peer.channel = None
                    peer.epoch += 1
                    peer.awaiting.clear()
                if not self._closed:
                    logger.warning(
                        "KV channel from %s failed (epoch %d): %s", peer.node_id, epoch, e
                    )
                    self.sink.on_peer_failed(peer.node_id, e)
                continue
            with peer.cond:
                peer.receiving = False

    def _receive_group(self, peer: _Peer, channel: PairChannel) -> None:
        headers = channel.recv_group(time.monotonic() + self.timeout_s)
        with peer.cond:
            for h in headers:
                if h.is_end:
                    peer.awaiting.pop(h.reservation_id, None)
        try:
            contexts = self.sink.on_group(peer.node_id, headers)
        except Exception:  # the channel is fine; the data of this group is unwanted
            logger.exception("handling KV segment headers from %s failed", peer.node_id)
            contexts = [None] * len(headers)
        plan = wire_order(headers)
        sizes = [desc.units * headers[i].unit_bytes for i, desc in plan]
        if not plan:
            return
        if sum(sizes) > self.max_group_bytes:
            raise TransferError(
                f"a KV group of {sum(sizes)} bytes was announced, more than this node's "
                f"whole KV cache ({self.max_group_bytes})"
            )
        # All receives are posted before any chunk can leave the sender: the
        # sender emits the group's chunks only after its layers ran.
        views = list(self._buffer(peer, sum(sizes)).split(sizes))
        works = [channel.post_recv(v) for v in views]
        for (i, desc), view, work in zip(plan, views, works, strict=True):
            channel.wait(work, time.monotonic() + self.timeout_s)
            try:
                self.sink.on_chunk(peer.node_id, contexts[i], desc, view, self.stream)
            except Exception:  # the channel is fine; this one chunk was not wanted
                logger.exception("handling a KV chunk from %s failed", peer.node_id)

    def _buffer(self, peer: _Peer, num_bytes: int) -> torch.Tensor:
        """The peer's receive buffer, reused from group to group: fresh host memory
        would be paged in while the wire writes it. A sink reads each chunk during
        ``on_chunk`` (on a GPU: on the receiver's stream, which the next group's
        receives wait for), never later."""
        if peer.buffer is None or peer.buffer.numel() < num_bytes:
            peer.buffer = None  # let the old one go first
            peer.buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        return peer.buffer[:num_bytes]

    def close(self) -> None:
        self._closed = True
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            with peer.cond:
                peer.cond.notify_all()
            if peer.channel is not None:
                peer.channel.close()
