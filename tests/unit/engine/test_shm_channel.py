"""The shared-memory channel of the tensor-parallel hand-off (one writer, readers
in other threads here; the engine's tests run it between processes)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engine.parallel.shm_channel import ChannelClosed, ShmBroadcast


@pytest.fixture
def channel():
    ch = ShmBroadcast.create(num_readers=2, capacity_words=64)
    yield ch
    ch.close()
    assert not os.path.exists(ch.name)  # the owner removes the file


def test_readers_that_attach_late_still_read_the_first_message(channel):
    channel.write([np.arange(5, dtype=np.int64)])  # before anyone attached
    readers = [ShmBroadcast.attach(channel.name, 2) for _ in range(2)]
    assert [r.read(i).tolist() for i, r in enumerate(readers)] == [[0, 1, 2, 3, 4]] * 2


def test_messages_arrive_in_order_and_whole(channel):
    readers = [ShmBroadcast.attach(channel.name, 2) for _ in range(2)]
    got: list[list[list[int]]] = [[], []]

    def follow(i: int) -> None:
        for _ in range(200):
            got[i].append(readers[i].read(i).tolist())

    threads = [threading.Thread(target=follow, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    sent = []
    for n in range(200):
        words = [np.full(n % 7 + 1, n, dtype=np.int64), np.array([-n], dtype=np.int64)]
        channel.write(words)  # waits until both read the last one
        sent.append(np.concatenate(words).tolist())
    for t in threads:
        t.join(10)
    assert got == [sent, sent]


def test_a_writer_whose_reader_died_raises_instead_of_waiting(channel, monkeypatch):
    monkeypatch.setattr("engine.parallel.shm_channel.CHECK_EVERY_S", 0.01)
    channel.write([np.ones(3, dtype=np.int64)])  # nobody reads it

    def reader_gone() -> None:
        raise ChannelClosed("reader 1 exited")

    with pytest.raises(ChannelClosed, match="reader 1 exited"):
        channel.write([np.ones(3, dtype=np.int64)], reader_gone)


def test_a_message_larger_than_the_channel_is_refused(channel):
    with pytest.raises(ValueError, match="exceeds"):
        channel.write([np.zeros(65, dtype=np.int64)])


def test_a_call_travels_between_steps_as_json_and_in_order():
    """Handoff's CALL messages: the method and its JSON payload arrive whole
    and in order with the step plans around them (a real store, real shm)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from engine.parallel.handoff import Call, Handoff, StepPlan
    from engine.step_inputs import host_inputs

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    rank0 = Handoff(SimpleNamespace(rank=0, size=2, is_driver=True, store=store), 4096)
    rank1 = Handoff(SimpleNamespace(rank=1, size=2, is_driver=False, store=store), 4096)
    try:
        got = []
        reader = threading.Thread(target=lambda: got.extend(rank1.recv() for _ in range(4)))
        reader.start()
        host = host_inputs([[5, 6, 7]], [0], [3], [[2]], 16)
        rank0.call(Call("kv_expect", b'{"reservation":7,"blocks":[1,2,3]}'))
        rank0.send(StepPlan(host))
        rank0.call(Call("odd", "\u00e9".encode()))  # a length that is not a multiple of 8
        rank0.stop()
        reader.join(10)
        assert got[0] == Call("kv_expect", b'{"reservation":7,"blocks":[1,2,3]}')
        assert got[1].host.input_ids.tolist() == [5, 6, 7]
        assert got[2] == Call("odd", "\u00e9".encode())
        assert got[3] is None
    finally:
        rank1.close()
        rank0.close()


def test_a_tier_batch_larger_than_the_channel_arrives_as_one_between_the_steps():
    """Handoff's TIER messages: a batch of host-tier copies split over several
    messages (a small channel) is received whole, pairs in order, with rank
    0's landed count and wait flag, and the step plan after it names the
    batches rank 0 had retired."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from engine.host_tier import TierCopies, TierPlan
    from engine.parallel.handoff import HEADER_WORDS, Handoff, StepPlan
    from engine.step_inputs import host_inputs

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    capacity = HEADER_WORDS + 2 * 3  # three pairs a message
    rank0 = Handoff(SimpleNamespace(rank=0, size=2, is_driver=True, store=store), 256)
    rank1 = Handoff(SimpleNamespace(rank=1, size=2, is_driver=False, store=store), 256)
    full, rank0.channel.capacity = rank0.channel.capacity, capacity
    big = TierCopies([(b, 100 + b) for b in range(7)], [(200 + s, s) for s in range(4)])
    try:
        got = []
        reader = threading.Thread(target=lambda: got.extend(rank1.recv() for _ in range(4)))
        reader.start()
        rank0.send_tier(TierPlan(big, landed=5))
        rank0.send_tier(TierPlan(TierCopies(), landed=6, wait=True))  # nothing new: a wait
        rank0.channel.capacity = full
        rank0.send(StepPlan(host_inputs([[5, 6, 7]], [0], [3], [[2]], 16), tier_landed=7))
        rank0.stop()
        reader.join(10)
        assert got[0] == TierPlan(big, landed=5, wait=False)
        assert got[1] == TierPlan(TierCopies(), landed=6, wait=True)
        assert got[2].tier_landed == 7 and got[2].host.input_ids.tolist() == [5, 6, 7]
        assert got[3] is None
    finally:
        rank1.close()
        rank0.close()
