"""Outputs handed from the engine's side to asyncio loops: ``RequestStream``.

A stream's ``sink`` is called under the engine's lock (on the engine thread,
or on a loop's own thread for a command run inline: engine/engine_thread.py)
and its items come out of ``async for`` on the stream's loop, in order. Items
for the streams of one loop wake it once per hand-over (``one_wake_per_loop``),
not once per item.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from engine.outputs import RequestOutput

T = TypeVar("T")


async def settled(future: Future[T]) -> T:
    """``future``'s result, awaited on the running loop; with no turn of the loop
    when it is done already (an inline command's): what the command handed over
    is then in its streams, and the caller goes on in the same turn."""
    if future.done():
        return future.result()
    return await asyncio.wrap_future(future)


class _Mailbox:
    """Items for the streams of one asyncio loop, handed over with one wake-up
    for as many as arrive before the loop takes them. A wake-up is a syscall on
    the sending thread and a point where it lets go of the GIL, which the loop
    (woken by it) may then keep while the engine thread waits."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._wake_pending = False
        self._lock = threading.Lock()

    def put(self, stream_queue: asyncio.Queue, item: Any) -> None:
        # (asyncio exports _get_running_loop: the calling thread's running
        # loop or None, with no exception raised on the engine thread.)
        if asyncio._get_running_loop() is self.loop:
            # An inline command's outputs, on the loop's own thread: straight
            # into the stream, behind whatever other threads left here first.
            self._take()
            stream_queue.put_nowait(item)
            return
        with self._lock:
            self._items.append((stream_queue, item))
            if self._wake_pending:
                return  # the loop has not taken the items before this one yet
            self._wake_pending = True
        deferred = getattr(_handing_over, "mailboxes", None)
        if deferred is not None:
            deferred.append(self)
        else:
            self.wake()

    def wake(self) -> None:
        # A closed loop raises RuntimeError: nobody reads its streams any more.
        with suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._take)

    def _take(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._wake_pending = False
        for stream_queue, item in items:
            stream_queue.put_nowait(item)


# The mailboxes a thread filled inside ``one_wake_per_loop``, woken at its end.
_handing_over = threading.local()
# One mailbox per loop, made by the first stream on it (loops are few and live long).
_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
    weakref.WeakKeyDictionary()
)
_mailboxes_lock = threading.Lock()


@contextmanager
def one_wake_per_loop() -> Iterator[None]:
    """Streams' items put inside this block wake their loop once, when it ends."""
    if getattr(_handing_over, "mailboxes", None) is not None:
        yield  # nested: the outer block wakes
        return
    _handing_over.mailboxes = deferred = []
    try:
        yield
    finally:
        _handing_over.mailboxes = None
        for mailbox in deferred:
            mailbox.wake()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _mailboxes_lock:
        mailbox = _mailboxes.get(loop)
        if mailbox is None:
            mailbox = _mailboxes[loop] = _Mailbox(loop)
        return mailbox


class RequestStream:
    """Outputs of one request, delivered from the engine thread to an asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._mailbox = _mailbox(self.loop)

    def sink(self, item: RequestOutput | BaseException) -> None:
        """From any thread; items keep their order."""
        self._mailbox.put(self.queue, item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def final(self) -> RequestOutput:
        last = None
        async for out in self:
            last = out
        if last is None:  # pragma: no cover - a finished output always comes
            raise RuntimeError("the request ended without an output")
        return last
