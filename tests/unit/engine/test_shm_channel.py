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
