"""Prefill-node side: one sending thread (and CUDA stream) per receiving rank.

A link is one rank of a decode node (just the node, at tensor-parallel size 1);
a tensor-parallel prefill node runs one sender per rank, each sending its own
KV heads to the decode ranks that need them (pairing.py).

Each link sends what is queued on it, in queue order, which is the wire order
(protocol.py): a step's group of headers just before its first chunk (on a CPU
when the step is launched: prefill_node/kv_stream.py), each chunk as soon as
its layers ran (on a GPU: after the event recorded behind them), the first
tokens the group carries once sampled, and a request's end header after its
last chunk. Groups are all or nothing: a
group whose requests are all gone (cancelled, failed, past their deadline)
before its first header leaves is skipped whole; once its headers are out every
one of its chunks follows, whatever becomes of the requests, because the
receiver has posted a receive for each.

On a GPU the thread only queues work (a wait on the chunk's event, the send)
and polls for completions to settle tickets: no host synchronisation per chunk.
On a CPU gloo's send blocks the thread, not the engine, which is computing the
next layers meanwhile.

A failure closes the channel; every request with a chunk on it or queued
behind it for the same channel incarnation fails (TransferError), and the next
transfer to that node builds a new channel under the epoch its Prefill names.
Building one (channel.py) announces this sender to the decode node and waits
at most ``connect_timeout_s`` for it, not the transfer timeout: the link's
thread is the one every transfer to that node waits behind.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.kv_transfer.channel import (
    POLL_S,
    SENDER,
    DeadlinePassed,
    EpochLeft,
    PairChannel,
    TransferError,
    closed_key,
    pair_key,
    ready_key,
)
from common.kv_transfer.checksum import checksum
from common.kv_transfer.protocol import ChunkDesc, SegmentHeader, group_messages
from common.kv_transfer.ticket import Destination, OutgoingSegment, number_group
from common.runtime.reliability import FaultDelays, FaultPoint

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Group:
    dest: Destination
    segments: list[OutgoingSegment]
    num_chunks: int = 0
    receiver_rank: int = 0  # which of the destination's ranks
    dropped: bool = False  # skipped before its headers left, or its channel broke
    chunks_sent: int = 0


@dataclass(slots=True)
class _Chunk:
    group: _Group
    segment: OutgoingSegment
    desc: ChunkDesc | None  # None: a first token (protocol.FLAG_TOKEN)
    data: torch.Tensor
    ready: torch.cuda.Event | None  # GPU: recorded behind the gather (timing-enabled)
    ready_at: float  # CPU: host time the chunk's layers were done
    last: bool  # its request's last chunk


@dataclass(slots=True)
class _Pending:
    """A posted send the thread has not seen complete yet."""

    work: dist.Work
    chunk: _Chunk | None  # None: a header
    posted_at: float
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    ready_seen: float | None = None  # when the host first saw its layers done


_IDLE = object()
# GPU: posted sends after which the thread settles completions even while more is queued.
_REAP_AFTER = 64


class _Link:
    """Everything this node holds for one decode node."""

    def __init__(self, owner: KVSender, node_id: str, receiver_rank: int) -> None:
        self.owner = owner
        self.node_id = node_id
        self.receiver_rank = receiver_rank
        self.timeout_s = owner.timeout_s
        self.queue: queue.Queue = queue.Queue()
        self.store: dist.TCPStore | None = None
        self.channel: PairChannel | None = None
        self.epoch = -1
        # Epochs this link has left (failed, or replaced by a newer one): the
        # decode node has dropped their channels, nothing more goes out on them.
        self.retired: set[int] = set()
        self.current: _Group | None = None  # the group whose chunks are still coming
        self.outstanding: deque[_Pending] = deque()
        self.last_done = 0.0  # gloo: when the last posted send was seen complete
        self.cuda = owner.device.type == "cuda"
        self.stream = torch.cuda.Stream(owner.device) if self.cuda else None
        self.thread = threading.Thread(
            target=self._run, name=f"kv-send-{node_id}-{receiver_rank}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.owner.device)  # a new thread starts on device 0
            # The current stream is per thread: this one's work all goes on the
            # link's stream (a stream context per send cost host time per chunk).
            torch.cuda.set_stream(self.stream)
        while True:
            try:
                if self.cuda:
                    item = self.queue.get(timeout=POLL_S if self.outstanding else None)
                else:
                    # gloo: post what is queued, wait once nothing more is (one
                    # wake-up per burst of chunks, not per chunk).
                    item = self.queue.get_nowait() if self.outstanding else self.queue.get()
            except queue.Empty:
                item = _IDLE
            if item is None:
                break
            try:
                if isinstance(item, _Group):
                    self._start(item)
                elif isinstance(item, _Chunk):
                    self._send(item)
                elif not self.cuda:
                    self._wait_oldest()
                # Post first, settle after: with chunks queued back to back,
                # settling one finished send between two posts (host time of
                # this thread's) left the wire idle
                # (docs/lab/2026-11-28-kv-wire-host-costs.md).
                if self.cuda and (self.queue.empty() or len(self.outstanding) > _REAP_AFTER):
                    self._reap()
            except Exception as e:
                self._fail(e)
        if self.outstanding or self.current is not None:
            self._fail(TransferError("the KV sender closed"))

    # ------------------------------------------------------------ messages
    def _start(self, group: _Group) -> None:
        if not group.segments[0].header.is_end:
            now = time.monotonic()
            tickets = [s.ticket for s in group.segments if s.ticket is not None]
            for t in tickets:
                if t.alive and now > t.deadline:
                    t.fail(DeadlinePassed("KV transfer deadline passed before sending"))
            if not any(t.alive for t in tickets):
                group.dropped = True  # nothing of it went out: the channel is in step
                return
        if group.dest.epoch in self.retired:
            group.dropped = True  # an end header for it is moot: the channel is gone
            self._fail_group(group, TransferError(f"the KV channel to {self.node_id} is gone"))
            return
        self.current = group  # from here on a failure fails it
        channel = self._channel_for(group.dest)
        now = time.monotonic()
        works = channel.send_headers([s.header for s in group.segments])
        self.outstanding.extend(_Pending(work, None, now) for work in works)
        if group.segments[0].header.is_end:
            self.current = None

    def _send(self, chunk: _Chunk) -> None:
        group = chunk.group
        if group.dropped:
            return  # never announced, or its channel broke (its tickets failed)
        channel = self.channel
        if channel is None or channel.closed or group is not self.current:
            raise TransferError("KV stream out of step: a chunk without its group")
        ticket = chunk.segment.ticket
        if ticket is not None and ticket.verify and chunk.desc is not None:
            if chunk.ready is not None:
                chunk.ready.synchronize()  # --verify-kv only: it reads the chunk on the host
            ticket.digests.append(checksum(chunk.data))
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            self.stream.wait_event(chunk.ready)
            start.record(self.stream)
            chunk.data.record_stream(self.stream)
            work = channel.send(chunk.data)
            work.wait()  # the stream (not the host) waits for the send
            end.record(self.stream)
            self.outstanding.append(_Pending(work, chunk, time.monotonic(), start, end))
        else:
            self.outstanding.append(_Pending(channel.send(chunk.data), chunk, time.monotonic()))
            if chunk.last:  # its request is waiting for this one: settle it now
                while self.outstanding:
                    self._wait_oldest()
        group.chunks_sent += 1
        if group.chunks_sent == group.num_chunks:
            self.current = None
        elif (
            group.chunks_sent == 1
            and any(s.final for s in group.segments)
            and (pause := self.owner.faults.get(FaultPoint.TRANSFER_MID))
        ):
            time.sleep(pause)  # fault tests: a request's last group held half-way

    def _sent(self, chunk: _Chunk, wire_s: float, exposed_s: float) -> None:
        ticket = chunk.segment.ticket
        if ticket is not None:
            nbytes = chunk.data.numel() * chunk.data.element_size()
            ticket.sent(nbytes, wire_s, chunk.last, exposed_s)

    def _wait_oldest(self) -> None:
        """gloo: wait for the oldest posted send (sends complete in order)."""
        p = self.outstanding[0]  # left in place until done: a failure fails its group
        if self.channel is None:
            raise TransferError("KV stream out of step: sends posted without a channel")
        self.channel.wait(p.work, p.posted_at + self.timeout_s)
        self.outstanding.popleft()
        now = time.monotonic()
        if p.chunk is not None:
            start = max(p.posted_at, self.last_done)
            self._sent(p.chunk, now - start, max(0.0, now - p.chunk.ready_at))
        self.last_done = now

    def _drain(self) -> None:
        """Until every posted send completed (before the channel is replaced)."""
        while self.outstanding:
            if self.cuda:
                self._reap()
                time.sleep(POLL_S)
            else:
                self._wait_oldest()

    def _reap(self) -> None:
        """GPU: settle the sends that completed, in order; a stuck one fails the link."""
        now = time.monotonic()
        while self.outstanding:
            p = self.outstanding[0]
            if not p.work.is_completed() or (p.end is not None and not p.end.query()):
                since = p.posted_at
                if p.chunk is not None and p.chunk.ready is not None:
                    # Its clock starts once its layers are done (the engine may
                    # have queued the whole forward long before it runs).
                    if p.ready_seen is None:
                        if not p.chunk.ready.query():
                            return
                        p.ready_seen = now
                    since = p.ready_seen
                if now - since > self.timeout_s:
                    raise TransferError(f"a KV send to {self.node_id} did not complete in time")
                return
            p.work.wait()  # raises if the send failed (on the link's stream: _run)
            self.outstanding.popleft()
            if p.chunk is not None and p.start is not None and p.end is not None:
                wire_s = p.start.elapsed_time(p.end) / 1e3
                exposed_s = p.chunk.ready.elapsed_time(p.end) / 1e3 if p.chunk.last else 0.0
                self._sent(p.chunk, wire_s, max(0.0, exposed_s))

    # ------------------------------------------------------------ channels
    def _channel_for(self, dest: Destination) -> PairChannel:
        if self.channel is not None and not self.channel.closed and self.epoch == dest.epoch:
            return self.channel
        if self.channel is not None:
            self._drain()
            self.channel.close()
            self.channel = None
        if self.epoch != dest.epoch:
            if self.epoch >= 0:
                self.retired.add(self.epoch)
            self.store = None
            self.epoch = dest.epoch  # from here on a failure retires this epoch
        connect = self.owner.connect_timeout_s
        if self.store is None:
            self.store = dist.TCPStore(
                dest.store_host,
                dest.store_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=connect),
            )
        key = pair_key(self.owner.node_id, self.owner.rank, self.receiver_rank, dest.epoch)
        if self.store.check([closed_key(key)]):
            raise EpochLeft(f"{self.node_id} left KV channel epoch {dest.epoch}")
        self.store.set(ready_key(key), "1")  # the receiver joins once this is there
        self.channel = PairChannel(self.store, key, SENDER, self.owner.device, connect)
        return self.channel

    def _fail(self, error: Exception) -> None:
        err = error if isinstance(error, TransferError) else TransferError(str(error))
        if self.epoch >= 0:
            self.retired.add(self.epoch)  # the receiver drops its side too
        if self.channel is not None:
            self.channel.close()
        # An epoch the decode node left is news, not a failure (its groups are moot).
        log = logger.info if isinstance(err, EpochLeft) else logger.warning
        log("KV transfer to %s failed: %s", self.node_id, err)
        self.channel = None
        # The decode node may have restarted: rendezvous through a fresh store
        # connection next time, not the one to the old process.
        self.store = None
        for p in self.outstanding:
            if p.chunk is not None:
                self._fail_group(p.chunk.group, err)
        self.outstanding.clear()
        if self.current is not None:
            self._fail_group(self.current, err)
            self.current = None

    @staticmethod
    def _fail_group(group: _Group, error: Exception) -> None:
        group.dropped = True
        for s in group.segments:
            if s.ticket is not None:
                s.ticket.fail(error)


class KVSender:
    def __init__(
        self,
        node_id: str,
        device: torch.device,
        timeout_s: float = 30.0,
        faults: FaultDelays | None = None,
        rank: int = 0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.node_id = node_id
        self.rank = rank  # this prefill node's rank
        self.device = device
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.faults = faults or FaultDelays()
        self._links: dict[tuple[str, int], _Link] = {}
        self._lock = threading.Lock()

    def _link(self, node_id: str, receiver_rank: int) -> _Link:
        with self._lock:
            link = self._links.get((node_id, receiver_rank))
            if link is None:
                link = self._links[node_id, receiver_rank] = _Link(self, node_id, receiver_rank)
            return link

    def open_group(
        self, dest: Destination, segments: list[OutgoingSegment], receiver_rank: int = 0
    ) -> _Group:
        """Queue a group's headers (numbered here) for one of the destination's
        ranks; its chunks follow with ``send_chunk``."""
        group = self.prepare_group(dest, segments, receiver_rank)
        self.post_group(group)
        return group

    def prepare_group(
        self, dest: Destination, segments: list[OutgoingSegment], receiver_rank: int = 0
    ) -> _Group:
        """``open_group`` without the queueing: everything that can fail (the
        link's thread is started here), so that ``post_group`` cannot."""
        number_group(segments)
        group = _Group(dest, segments, group_messages([s.header for s in segments]))
        group.receiver_rank = receiver_rank
        self._link(dest.node_id, receiver_rank)
        return group

    def post_group(self, group: _Group) -> None:
        """Queue a prepared group's headers; its chunks follow with ``send_chunk``."""
        self._links[group.dest.node_id, group.receiver_rank].queue.put(group)

    def send_chunk(
        self,
        group: _Group,
        segment: OutgoingSegment,
        desc: ChunkDesc | None,
        data: torch.Tensor,
        ready: torch.cuda.Event | None,
        ready_at: float,
        last: bool,
    ) -> None:
        """Queue one chunk, in wire order (``protocol.wire_order``) within its
        group; ``desc`` None: a segment's first token, after every chunk."""
        chunk = _Chunk(group, segment, desc, data, ready, ready_at, last)
        self._link(group.dest.node_id, group.receiver_rank).queue.put(chunk)

    def end(
        self,
        dest: Destination,
        reservation_id: int,
        receiver_rank: int = 0,
        heads: tuple[int, int] = (0, 0),
        digest: bytes = b"",
    ) -> None:
        """Queue the end header of a reservation's stream of these KV heads to
        one of the destination's ranks (after all of its chunks to that rank);
        ``digest``: the chunks' chained checksum (--verify-kv)."""
        header = SegmentHeader.end(reservation_id, heads, digest)
        group = _Group(dest, [OutgoingSegment(header, None)], receiver_rank=receiver_rank)
        self._link(dest.node_id, receiver_rank).queue.put(group)

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.queue.put(None)
        for link in links:
            link.thread.join(timeout=5)
            if link.channel is not None:
                link.channel.close()
