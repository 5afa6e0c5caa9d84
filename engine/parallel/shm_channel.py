"""One writer, several readers, one message at a time, in shared memory.

The tensor-parallel hand-off (engine/parallel/handoff.py) runs once per
engine step, so its latency is added to every step. Over gloo (TCP on
loopback) a step needs two broadcasts, each a round trip through the kernel's
network stack (docs/lab/2026-11-24-tp-handoff.md); here rank 0
writes the message's int64 words into a shared-memory segment and bumps a
sequence number, and each follower, polling that number, copies the words
and acknowledges. The writer waits for every acknowledgement of message N
before it writes N+1 (one slot: a follower always reads a whole message).

Layout (int64 words): [0] sequence number, [1 + i] follower i's last read
sequence, then [CONTROL_WORDS] the message length n and its n words.

Readers poll hot (yielding the CPU) for ``HOT_S`` after a message, then
sleep ``IDLE_SLEEP_S`` between polls, so an idle engine costs no CPU and its
first step after idling waits at most that long. Both sides check that the
other is alive while they wait (``alive`` callbacks): a writer whose reader
died, or a reader whose writer died, raises instead of spinning forever.

Ordering: x86's stores become visible in program order (TSO), so a reader
that sees the new sequence number sees the words written before it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from collections.abc import Callable

import numpy as np

CONTROL_WORDS = 16  # sequence + up to 8 acknowledgements, padded
HOT_S = 0.05
IDLE_SLEEP_S = 0.0005
CHECK_EVERY_S = 0.5


class ChannelClosed(RuntimeError):
    """The other side of the channel is gone."""


class ShmBroadcast:
    def __init__(self, path: str, num_readers: int, owner: bool, size_words: int = 0) -> None:
        if num_readers > CONTROL_WORDS - 2:
            raise ValueError(f"at most {CONTROL_WORDS - 2} readers; got {num_readers}")
        self.path = path
        self.owner = owner
        self.num_readers = num_readers
        # A file in /dev/shm mapped by every rank (not multiprocessing's
        # SharedMemory: its resource tracker would unlink the segment when the
        # first of the processes exits).
        mode = "w+" if owner else "r+"
        shape = (size_words,) if owner else None
        self.words = np.memmap(path, dtype=np.int64, mode=mode, shape=shape)
        self.capacity = len(self.words) - CONTROL_WORDS - 1
        # Every side starts at 0, not at what the segment says: a reader that
        # attaches after the first message must still read it.
        self.seq = 0

    @classmethod
    def create(cls, num_readers: int, capacity_words: int) -> ShmBroadcast:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"pdserve-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        return cls(path, num_readers, owner=True, size_words=CONTROL_WORDS + 1 + capacity_words)

    @classmethod
    def attach(cls, path: str, num_readers: int) -> ShmBroadcast:
        return cls(path, num_readers, owner=False)

    @property
    def name(self) -> str:
        return self.path

    # ------------------------------------------------------------------ writer
    def write(self, parts: list[np.ndarray], alive: Callable[[], None] | None = None) -> None:
        """Publish the concatenation of ``parts`` (int64) as the next message."""
        n = sum(len(p) for p in parts)
        if n > self.capacity:
            raise ValueError(f"hand-off message of {n} words exceeds the channel's {self.capacity}")
        acks = self.words[1 : 1 + self.num_readers]
        _wait(lambda: bool((acks == self.seq).all()), alive)
        w = self.words
        w[CONTROL_WORDS] = n
        pos = CONTROL_WORDS + 1
        for p in parts:
            w[pos : pos + len(p)] = p
            pos += len(p)
        self.seq += 1
        w[0] = self.seq  # last: readers that see it see the words

    # ------------------------------------------------------------------ reader
    def read(self, reader: int, alive: Callable[[], None] | None = None) -> np.ndarray:
        """The next message's words (a copy), once rank 0 wrote it."""
        w = self.words
        _wait(lambda: w[0] != self.seq, alive)
        self.seq = int(w[0])
        n = int(w[CONTROL_WORDS])
        out = w[CONTROL_WORDS + 1 : CONTROL_WORDS + 1 + n].copy()
        w[1 + reader] = self.seq
        return out

    def close(self, unlink: bool | None = None) -> None:
        """Unmap; the owner (or a reader whose owner died: ``unlink=True``)
        also removes the file."""
        self.words = None
        if self.owner if unlink is None else unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _wait(ready: Callable[[], bool], alive: Callable[[], None] | None) -> None:
    if ready():
        return
    start = last_check = time.monotonic()
    while not ready():
        now = time.monotonic()
        if now - last_check > CHECK_EVERY_S:
            last_check = now
            if alive is not None:
                alive()  # raises when the other side is gone
        time.sleep(0 if now - start < HOT_S else IDLE_SLEEP_S)


def parent_alive(parent_pid: int) -> Callable[[], None]:
    """For a follower: raise ChannelClosed once its parent (rank 0) is gone."""

    def check() -> None:
        if os.getppid() != parent_pid:
            raise ChannelClosed("rank 0 is gone")

    return check
