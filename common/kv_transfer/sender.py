"""Prefill-node side: one sending thread (and CUDA stream) per decode node."""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.kv_transfer.channel import SENDER, DeadlinePassed, PairChannel, TransferError
from common.kv_transfer.protocol import TransferHeader
from common.reliability import FaultDelays, FaultPoint

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Destination:
    node_id: str  # the decode node
    store_host: str  # its TCPStore
    store_port: int
    epoch: int  # the channel incarnation it expects


@dataclass(slots=True)
class _Item:
    dest: Destination
    header: TransferHeader
    payload: torch.Tensor
    ready: torch.cuda.Event | None
    deadline: float
    future: Future


class _Link:
    """Everything this node holds for one decode node."""

    def __init__(self, owner: KVSender, node_id: str) -> None:
        self.owner = owner
        self.node_id = node_id
        self.queue: queue.Queue[_Item | None] = queue.Queue()
        self.store: dist.TCPStore | None = None
        self.channel: PairChannel | None = None
        self.epoch = -1
        self.stream = torch.cuda.Stream(owner.device) if owner.device.type == "cuda" else None
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{node_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.owner.device.type == "cuda":
            torch.cuda.set_device(self.owner.device)  # a new thread starts on device 0
        while (item := self.queue.get()) is not None:
            # Cancelled while queued (the request is gone): skip it, nothing is
            # on the wire yet. Once running, the future cannot be cancelled any
            # more, so a transfer that started always completes or fails whole
            # and the channel stays in step with the receiver.
            if not item.future.set_running_or_notify_cancel():
                continue
            try:
                start = time.perf_counter()
                self._send(item)
                item.future.set_result(time.perf_counter() - start)
            except DeadlinePassed as e:  # nothing was sent: the channel is fine
                item.future.set_exception(e)
            except Exception as e:
                if self.channel is not None:
                    self.channel.close()
                self.channel = None
                # The decode node may have restarted: rendezvous through a fresh
                # store connection next time, not the one to the old process.
                self.store = None
                logger.warning("KV transfer to %s failed: %s", self.node_id, e)
                item.future.set_exception(
                    e if isinstance(e, TransferError) else TransferError(str(e))
                )

    def _send(self, item: _Item) -> None:
        dest = item.dest
        if time.monotonic() > item.deadline:
            raise DeadlinePassed("KV transfer deadline passed before sending")
        if self.channel is None or self.channel.closed or self.epoch != dest.epoch:
            if self.channel is not None:
                self.channel.close()
            if self.store is None or self.epoch != dest.epoch:
                self.store = dist.TCPStore(
                    dest.store_host,
                    dest.store_port,
                    is_master=False,
                    timeout=_timedelta(self.owner.timeout_s),
                )
            self.channel = None
            self.channel = PairChannel(
                self.store,
                f"pair/{self.owner.node_id}/{dest.epoch}",
                SENDER,
                self.owner.device,
                self.owner.timeout_s,
            )
            self.epoch = dest.epoch
        pause = self.owner.faults.get(FaultPoint.TRANSFER_MID)
        if self.stream is not None:
            # Send on our own stream once the gather that made the payload is done;
            # the engine's stream goes on with the next step meanwhile.
            with torch.cuda.stream(self.stream):
                if item.ready is not None:
                    self.stream.wait_event(item.ready)
                item.payload.record_stream(self.stream)
                self.channel.send(item.header, item.payload, item.deadline, pause)
        else:
            self.channel.send(item.header, item.payload, item.deadline, pause)


class KVSender:
    def __init__(
        self,
        node_id: str,
        device: torch.device,
        timeout_s: float = 30.0,
        faults: FaultDelays | None = None,
    ) -> None:
        self.node_id = node_id
        self.device = device
        self.timeout_s = timeout_s
        self.faults = faults or FaultDelays()
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()

    def submit(
        self,
        dest: Destination,
        header: TransferHeader,
        payload: torch.Tensor,
        ready: torch.cuda.Event | None = None,
        deadline: float | None = None,
    ) -> Future:
        """Queue a transfer; the future gives the seconds it took, or a TransferError."""
        future: Future = Future()
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout_s
        with self._lock:
            link = self._links.get(dest.node_id)
            if link is None:
                link = self._links[dest.node_id] = _Link(self, dest.node_id)
        link.queue.put(_Item(dest, header, payload, ready, deadline, future))
        return future

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.queue.put(None)
        for link in links:
            link.thread.join(timeout=5)
            if link.channel is not None:
                link.channel.close()


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
