"""KV transfer over real gloo channels between real processes."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

from common.kv_transfer import Destination, KVReceiver, KVSender, TransferError, TransferHeader
from pdserve.redis_server import free_port


def payload(i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, generator=g).to(torch.bfloat16)


def sender_main(port: int, epochs, count: int, sizes: list[int], results) -> None:
    sender = KVSender("prefill-a", torch.device("cpu"), timeout_s=10)
    # Say we are up (torch imported) before the receiver starts its short
    # rendezvous clock: a spawned interpreter can take seconds on a loaded host.
    results.put("ready")
    epoch = epochs.get(timeout=60)
    dest = Destination("decode-a", "127.0.0.1", port, epoch)
    futures = []
    for i in range(count):
        data = payload(i, sizes[i])
        header = TransferHeader(
            reservation_id=100 + i, num_blocks=i + 1, num_bytes=data.numel() * 2, first_token=7 * i
        )
        futures.append(sender.submit(dest, header, data))
    results.put([f.result(timeout=30) > 0 for f in futures])
    sender.close()


class Collector:
    def __init__(self):
        self.got: dict[int, tuple[TransferHeader, torch.Tensor]] = {}
        self.failed: list[str] = []
        self.event = threading.Event()

    def on_transfer(self, peer, header, data, stream):
        self.got[header.reservation_id] = (header, data)
        self.event.set()

    def on_peer_failed(self, peer, error):
        self.failed.append(peer)
        self.event.set()


@pytest.fixture
def receiver():
    col = Collector()
    port = free_port()
    rx = KVReceiver(
        "decode-a",
        "127.0.0.1",
        port,
        torch.device("cpu"),
        col.on_transfer,
        col.on_peer_failed,
        timeout_s=3,
        first_epoch=0,  # the sender processes below start at epoch 0
    )
    yield rx, col, port
    rx.close()


def start_sender(port: int, sizes: list[int]):
    """A sender in its own process, up and waiting for its epoch."""
    ctx = mp.get_context("spawn")
    epochs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=sender_main, args=(port, epochs, len(sizes), sizes, results))
    proc.start()
    assert results.get(timeout=120) == "ready"
    return proc, epochs, results


def test_transfers_arrive_bit_identical_in_order(receiver):
    rx, col, port = receiver
    sizes = [5, 4096, 1 << 20, 3]
    proc, epochs, results = start_sender(port, sizes)
    for i in range(len(sizes)):  # one expectation per reservation; the epoch is shared
        epoch = rx.expect("prefill-a", 100 + i)
    epochs.put(epoch)
    assert results.get(timeout=60) == [True] * len(sizes)
    proc.join(30)
    deadline = time.monotonic() + 10
    while len(col.got) < len(sizes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(col.got) == [100, 101, 102, 103]
    for i, n in enumerate(sizes):
        header, data = col.got[100 + i]
        assert header.num_blocks == i + 1 and header.first_token == 7 * i
        assert torch.equal(data.view(torch.bfloat16), payload(i, n))  # bit-identical
    assert col.failed == []


def test_absent_peer_times_out_then_the_next_epoch_works(receiver):
    rx, col, port = receiver
    assert rx.expect("prefill-a", 100) == 0
    # Nobody connects: the rendezvous times out, the peer is reported, the epoch moves on.
    assert col.event.wait(15)
    assert col.failed == ["prefill-a"]
    col.event.clear()
    proc, epochs, results = start_sender(port, [64])
    epoch = rx.expect("prefill-a", 100)
    assert epoch == 1
    epochs.put(epoch)
    assert results.get(timeout=60) == [True]
    proc.join(30)
    assert col.event.wait(10) and 100 in col.got


def test_sender_reports_a_peer_that_never_listens():
    port = free_port()
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False
    )  # nobody receives
    sender = KVSender("prefill-b", torch.device("cpu"), timeout_s=1)
    fut = sender.submit(
        Destination("decode-x", "127.0.0.1", port, 0),
        TransferHeader(1, 1, 8, 0),
        torch.zeros(4, dtype=torch.bfloat16),
    )
    with pytest.raises(TransferError):
        fut.result(timeout=30)
    sender.close()
    del store


def test_header_round_trip_and_rejection():
    h = TransferHeader(2**40 + 3, 12, 99 << 20, 49151, bytes(range(16)))
    assert TransferHeader.from_tensor(h.to_tensor()) == h
    bad = h.to_tensor()
    bad[0] = 1
    with pytest.raises(ValueError, match="not a KV transfer header"):
        TransferHeader.from_tensor(bad)
