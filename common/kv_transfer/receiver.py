"""Decode-node side: hosts the TCPStore; one receiving thread per sending rank.

A *peer* is one rank of a prefill node (just the node, at tensor-parallel size
1); each has its own pair channel and thread. A tensor-parallel decode node
runs one receiver per rank: rank 0's hosts the store and owns the channel
epochs (one per prefill node, shared by all the pair channels between the two
nodes), the others connect to its store and are told the epoch with each
reservation (``expect(..., epoch=)``); an epoch older than one that failed
here is refused (``StaleEpoch``).

A peer's thread keeps a header receive posted while any reservation of that
peer is awaited: from ``expect`` until the reservation's end header arrives
(after ``unexpect`` too, so that segments the prefill node sent before it
learnt of a cancellation are read and dropped rather than left blocking its
channel). How long it waits for the prefill node to start sending is
``wait_s`` (the decode node's KV lease, which bounds each request's wait
anyway), not the transfer timeout: a busy prefill node starts a prompt late,
and a channel closed for that would fail the reservations it was about to
fill, while the prefill node went on sending on the epoch the receiver left.
The transfer timeout bounds the chunks of a group once its headers came. A
channel is built only once its sender announced itself (channel.py), each
side within ``connect_timeout_s``. For each group it reads the k headers
(a block message: protocol.py), posts every chunk's receive at once into one
buffer -- sizes and order follow from the headers (protocol.wire_order) --
then hands the headers to the sink (``on_group``), and each chunk
(``on_chunk``) as soon as it landed, while the later ones are still on the
wire; then each first token the group carries (``on_first_token``). A failure or a passed deadline closes the
channel, bumps the node's epoch (the next transfer rebuilds the group) and
reports the peer (``on_peer_failed``) so that waiting reservations fail fast.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from common.kv_transfer.channel import (
    RECEIVER,
    PairChannel,
    TransferError,
    closed_key,
    pair_key,
    ready_key,
)
from common.kv_transfer.protocol import (
    ChunkDesc,
    FirstToken,
    SegmentHeader,
    parse_first_token,
    token_message_bytes,
    token_order,
    wire_order,
)

logger = logging.getLogger(__name__)

# How often a receiver waiting for its sender's announcement checks that a
# reservation still wants the channel.
ANNOUNCE_POLL_S = 0.25


class StaleEpoch(RuntimeError):
    """A reservation names a channel epoch that already failed on this rank."""


class KVSink(Protocol):
    """Where received KV goes (the decode node's landing; tests' collectors).
    ``peer`` is the prefill node's id (its ranks' data come on their own threads)."""

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

    def on_first_token(self, peer: str, segment: object, token: FirstToken) -> None:
        """The prompt's first token, after its last segment's chunks (FLAG_TOKEN)."""
        ...

    def on_peer_failed(self, peer: str, error: Exception, epoch: int) -> None:
        """The channel from one of ``peer``'s ranks failed under ``epoch``."""
        ...


@dataclass(slots=True)
class _Peer:
    node_id: str
    rank: int  # the sending node's rank
    channel_epoch: int = -1  # the epoch ``channel`` was built under
    # Reservation id -> None while its request waits for it, or the time until
    # which it lingers after the request gave up (its end header not yet seen).
    # A dict, not a count: each reservation ends on its own header.
    awaiting: dict[int, float | None] = field(default_factory=dict)
    receiving: bool = False  # a receive is posted on the channel
    channel: PairChannel | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None
    buffer: torch.Tensor | None = None  # receive buffer (KVReceiver._buffer)
    store: dist.Store | None = None  # this thread's own connection to the store

    def wants_data(self) -> bool:
        now = time.monotonic()
        for rid, until in list(self.awaiting.items()):
            if until is not None and until < now:
                del self.awaiting[rid]  # its end never came (the Prefill never ran)
        return bool(self.awaiting)

    def group_deadline(self, wait_s: float) -> float:
        """Until when to wait for the next group's headers (``wants_data`` was
        true): ``wait_s`` while a request awaits one, else until the last
        lingering reservation's end is due."""
        untils = self.awaiting.values()
        if any(until is None for until in untils):
            return time.monotonic() + wait_s
        return max(untils)


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
        rank: int = 0,
        connect_timeout_s: float = 5.0,
        wait_s: float | None = None,
    ) -> None:
        self.node_id = node_id
        self.rank = rank  # this decode node's rank (0 hosts the store)
        # Epochs start at the clock (microseconds since 1970): a restarted decode
        # node must not name an epoch (a rendezvous key) a sender still holds
        # from its previous process, and its epochs must be newer than that
        # process's, since a prefill node takes a lower one for stale
        # (prefill_node/kv_stream.py). Benchmarks and tests pin it.
        self._first_epoch = first_epoch
        self.host = host
        self.port = port
        self.device = device
        self.timeout_s = timeout_s  # a started group's chunks, each
        self.connect_timeout_s = connect_timeout_s
        # For a prefill node to start sending (module docstring); the KV lease.
        self.wait_s = timeout_s if wait_s is None else wait_s
        self.sink = sink
        # A group can never be larger than what the node could land (its cache).
        self.max_group_bytes = max_group_bytes
        self.store = dist.TCPStore(
            host,
            port,
            is_master=rank == 0,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=connect_timeout_s),
        )
        self._peers: dict[tuple[str, int], _Peer] = {}
        # Prefill node -> its current channel epoch (every pair channel with it).
        self._epochs: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def epoch_of(self, node_id: str) -> int:
        """The channel epoch for ``node_id`` (rank 0 chooses it on first use)."""
        with self._lock:
            epoch = self._epochs.get(node_id)
            if epoch is None:
                first = self._first_epoch
                epoch = self._epochs[node_id] = time.time_ns() // 1000 if first is None else first
            return epoch

    def expect(
        self,
        peer_id: str,
        reservation_id: int,
        sender_rank: int = 0,
        epoch: int | None = None,
    ) -> int:
        """A transfer for ``reservation_id`` will come from ``peer_id``'s rank
        ``sender_rank``; returns the epoch it must use. A rank other than 0 is
        given the epoch; one older than this rank's is refused (``StaleEpoch``)."""
        if epoch is None:
            epoch = self.epoch_of(peer_id)
        with self._lock:
            current = self._epochs.get(peer_id, epoch)
            if epoch < current:
                raise StaleEpoch(
                    f"reservation {reservation_id} names epoch {epoch} of the channels from "
                    f"{peer_id}, which failed here (now {current})"
                )
            self._epochs[peer_id] = epoch
            key = (peer_id, sender_rank)
            peer = self._peers.get(key)
            if peer is None:
                peer = self._peers[key] = _Peer(peer_id, sender_rank)
                peer.thread = threading.Thread(
                    target=self._run,
                    args=(peer,),
                    name=f"kv-recv-{peer_id}-{sender_rank}",
                    daemon=True,
                )
                peer.thread.start()
        with peer.cond:
            peer.awaiting[reservation_id] = None
            peer.cond.notify()
        return epoch

    def unexpect(self, peer_id: str, reservation_id: int, sender_rank: int = 0) -> None:
        """The request no longer wants this transfer: keep reading (and dropping)
        what the peer sends for it until its end header, for at most ``wait_s``."""
        peer = self._peers.get((peer_id, sender_rank))
        if peer is not None:
            with peer.cond:
                if reservation_id in peer.awaiting:
                    peer.awaiting[reservation_id] = time.monotonic() + self.wait_s

    def reset(self, peer_id: str) -> None:
        """The peer failed or restarted (its Prefill call broke): the channels
        with it move to a new epoch, so that the next transfer rendezvouses anew
        instead of posting a receive to a dead process. Idle channels close now,
        busy ones after their group."""
        with self._lock:
            old = self._epochs.get(peer_id)
            if old is not None:
                self._epochs[peer_id] = old + 1
            peers = [p for (node, _), p in self._peers.items() if node == peer_id]
        for peer in peers:
            if old is not None:
                self._mark_closed(peer, old)
            with peer.cond:
                if not peer.receiving and peer.channel is not None:
                    peer.channel.close()
                    peer.channel = None
                    for rid, until in list(peer.awaiting.items()):
                        if until is not None:  # lingering on the old channel: moot now
                            del peer.awaiting[rid]
                peer.cond.notify_all()  # a wait for the old epoch's sender ends

    def fail_epoch(self, peer_id: str, epoch: int) -> bool:
        """``epoch`` of the channels with ``peer_id`` failed (on some rank): move
        on to the next, once. True when this call moved it."""
        with self._lock:
            if self._epochs.get(peer_id) != epoch:
                return False
        self.reset(peer_id)
        return True

    def _run(self, peer: _Peer) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        while not self._closed:
            epoch = self._await_work(peer)
            if epoch is None:
                return
            try:
                channel = self._channel(peer, epoch)
                with peer.cond:  # after the channel: building it may have taken a while
                    wanted = channel is not None and peer.wants_data()
                    deadline = peer.group_deadline(self.wait_s) if wanted else 0.0
                if wanted:
                    with (
                        torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
                    ):
                        self._receive_group(peer, channel, deadline)
            except Exception as e:
                self._channel_failed(peer, epoch, e)
            finally:
                with peer.cond:
                    peer.receiving = False

    def _await_work(self, peer: _Peer) -> int | None:
        """Until a reservation of ``peer`` wants data: the channel epoch (None:
        the receiver closed)."""
        with peer.cond:
            while not peer.wants_data() and not self._closed:
                peer.cond.wait(timeout=0.5)
            if self._closed:
                return None
            with self._lock:
                epoch = self._epochs[peer.node_id]
            peer.receiving = True
            return epoch

    def _channel(self, peer: _Peer, epoch: int) -> PairChannel | None:
        """The channel of ``epoch``, built once its sender announced itself;
        None when no reservation wants it any more (or the epoch moved on) first."""
        if peer.channel is not None and (peer.channel.closed or peer.channel_epoch != epoch):
            peer.channel.close()  # the node moved on: a fresh rendezvous
            self._mark_closed(peer, peer.channel_epoch)
            peer.channel = None
        if peer.channel is None:
            key = pair_key(peer.node_id, peer.rank, self.rank, epoch)
            if not self._await_sender(peer, key, epoch):
                return None
            peer.channel = PairChannel(
                self._store_of(peer), key, RECEIVER, self.device, self.connect_timeout_s
            )
            peer.channel_epoch = epoch
        return peer.channel

    def _await_sender(self, peer: _Peer, key: str, epoch: int) -> bool:
        """Until the sender announced itself under ``key``; False when nothing
        wants the channel any more, the epoch moved on or the receiver closed."""
        store = self._store_of(peer)
        poll = datetime.timedelta(seconds=ANNOUNCE_POLL_S)
        while not self._closed:
            try:
                store.wait([ready_key(key)], poll)
                return True
            except dist.DistStoreError:  # not yet
                pass
            with peer.cond:
                if not peer.wants_data():
                    return False
            with self._lock:
                if self._epochs.get(peer.node_id) != epoch:
                    return False
        return False

    def _store_of(self, peer: _Peer) -> dist.Store:
        """``peer``'s own connection to the store: a wait on a connection
        holds it, and one peer's waits must not hold up another's rendezvous."""
        if peer.store is None:
            peer.store = dist.TCPStore(
                self.host,
                self.port,
                is_master=False,
                timeout=datetime.timedelta(seconds=self.connect_timeout_s),
            )
        return peer.store

    def _mark_closed(self, peer: _Peer, epoch: int) -> None:
        """Tell ``peer``'s sender that this rank left ``epoch``: it must not
        wait in a rendezvous there (best effort)."""
        if epoch < 0:
            return
        key = closed_key(pair_key(peer.node_id, peer.rank, self.rank, epoch))
        with contextlib.suppress(Exception):
            self.store.set(key, "1")

    def _channel_failed(self, peer: _Peer, epoch: int, error: Exception) -> None:
        """The channel (or its rendezvous) failed: close it, move the node to
        the next epoch, fail what waits on it."""
        with peer.cond:
            if peer.channel is not None:
                peer.channel.close()
            peer.channel = None
            peer.awaiting.clear()
        self._mark_closed(peer, epoch)
        with self._lock:
            if self._epochs.get(peer.node_id) == epoch:
                self._epochs[peer.node_id] = epoch + 1
        if not self._closed:
            logger.warning(
                "KV channel from %s rank %d failed (epoch %d): %s",
                peer.node_id,
                peer.rank,
                epoch,
                error,
            )
            self.sink.on_peer_failed(peer.node_id, error, epoch)

    def _receive_group(self, peer: _Peer, channel: PairChannel, deadline: float) -> None:
        headers = channel.recv_group(deadline)
        with peer.cond:
            for h in headers:
                if h.is_end:
                    peer.awaiting.pop(h.reservation_id, None)
        plan = wire_order(headers)
        tokens = token_order(headers)
        sizes = [desc.units * headers[i].unit_bytes for i, desc in plan]
        if sum(sizes) > self.max_group_bytes:
            raise TransferError(
                f"a KV group of {sum(sizes)} bytes was announced, more than this node's "
                f"whole KV cache ({self.max_group_bytes})"
            )
        # Every receive is posted before the sink hears of the group: the
        # sender's first chunk may be on its way already (its send waits for
        # the receive), and the sink's work (the landing's lookups and block
        # indexes) need not come first.
        sizes += [token_message_bytes(headers[i]) for i in tokens]
        views = list(self._buffer(peer, sum(sizes)).split(sizes)) if plan else []
        works = [channel.post_recv(v) for v in views]
        try:
            contexts = self.sink.on_group(peer.node_id, headers)
        except Exception:  # the channel is fine; the data of this group is unwanted
            logger.exception("handling KV segment headers from %s failed", peer.node_id)
            contexts = [None] * len(headers)
        if not plan:
            return
        n = len(plan)
        for (i, desc), view, work in zip(plan, views[:n], works[:n], strict=True):
            channel.wait(work, time.monotonic() + self.timeout_s)
            try:
                self.sink.on_chunk(peer.node_id, contexts[i], desc, view, self.stream)
            except Exception:  # the channel is fine; this one chunk was not wanted
                logger.exception("handling a KV chunk from %s failed", peer.node_id)
        for i, view, work in zip(tokens, views[n:], works[n:], strict=True):
            channel.wait(work, time.monotonic() + self.timeout_s)
            # Its bytes to the host (behind the receiver's stream only).
            token = parse_first_token(headers[i], view.cpu().numpy().tobytes())
            try:
                self.sink.on_first_token(peer.node_id, contexts[i], token)
            except Exception:
                logger.exception("handling a first token from %s failed", peer.node_id)

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
