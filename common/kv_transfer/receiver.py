"""Decode-node side: hosts the TCPStore; one receiving thread per prefill node.

A peer's thread posts a receive only while at least one transfer from that
peer is expected (``expect``), reads the header, then exactly the payload the
header announces, and hands both to ``on_transfer``, which decides whether the
named reservation still wants it. A failure or a passed deadline closes the
channel, bumps the peer's epoch (the next transfer rebuilds the group) and
reports the peer to ``on_peer_failed`` so that waiting reservations fail fast.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from common.kv_transfer.channel import RECEIVER, PairChannel
from common.kv_transfer.protocol import TransferHeader

logger = logging.getLogger(__name__)

OnTransfer = Callable[[str, TransferHeader, torch.Tensor, "torch.cuda.Stream | None"], None]
OnPeerFailed = Callable[[str, Exception], None]


@dataclass(slots=True)
class _Peer:
    node_id: str
    epoch: int
    # Reservations whose transfer has not started yet; a receive is posted
    # while any is awaited. A set, not a count: a request cancelled after its
    # header arrived must not also cancel someone else's expectation.
    awaiting: set[int] = field(default_factory=set)
    receiving: bool = False  # a receive is posted on the channel
    channel: PairChannel | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    thread: threading.Thread | None = None


class KVReceiver:
    def __init__(
        self,
        node_id: str,
        host: str,
        port: int,
        device: torch.device,
        on_transfer: OnTransfer,
        on_peer_failed: OnPeerFailed,
        timeout_s: float = 30.0,
        first_epoch: int | None = None,
    ) -> None:
        self.node_id = node_id
        # Epochs start at a random point: a restarted decode node must not name
        # an epoch (a rendezvous key) a sender still holds from the previous
        # process. Benchmarks pin it.
        self._first_epoch = first_epoch
        self.host = host
        self.port = port
        self.device = device
        self.timeout_s = timeout_s
        self.on_transfer = on_transfer
        self.on_peer_failed = on_peer_failed
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
            peer.awaiting.add(reservation_id)
            peer.cond.notify()
            return peer.epoch

    def unexpect(self, peer_id: str, reservation_id: int) -> None:
        """The transfer for ``reservation_id`` is no longer wanted (a no-op once
        its header arrived: then it is received and dropped)."""
        peer = self._peers.get(peer_id)
        if peer is not None:
            with peer.cond:
                peer.awaiting.discard(reservation_id)

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

    def _run(self, peer: _Peer) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        while not self._closed:
            with peer.cond:
                while not peer.awaiting and not self._closed:
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
                channel = peer.channel
                deadline = time.monotonic() + self.timeout_s
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        header = self._recv_header(peer, channel, deadline)
                        payload = channel.recv_payload(
                            header.num_bytes, time.monotonic() + self.timeout_s
                        )
                else:
                    header = self._recv_header(peer, channel, deadline)
                    payload = channel.recv_payload(
                        header.num_bytes, time.monotonic() + self.timeout_s
                    )
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
                    self.on_peer_failed(peer.node_id, e)
                continue
            with peer.cond:
                peer.receiving = False
            try:
                self.on_transfer(peer.node_id, header, payload, self.stream)
            except Exception:  # the channel is fine; this one transfer was not wanted
                logger.exception("handling a KV transfer from %s failed", peer.node_id)

    @staticmethod
    def _recv_header(peer: _Peer, channel: PairChannel, deadline: float) -> TransferHeader:
        header = channel.recv_header(deadline)
        with peer.cond:
            peer.awaiting.discard(header.reservation_id)
        return header

    def close(self) -> None:
        self._closed = True
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            with peer.cond:
                peer.cond.notify_all()
            if peer.channel is not None:
                peer.channel.close()
