"""Runs an LLMEngine on a thread of its own: the only thread that ever touches it.

The nodes' gRPC handlers live on an asyncio loop; the engine steps on this
thread. Other threads hand it work with ``call(fn)`` (``fn(engine)`` runs
between two steps; its result or exception comes back through a Future) and
receive outputs through per-request sinks, called on this thread after each
step. ``RequestStream`` turns a sink into an async iterator on the caller's loop.

A step's outputs go to their streams with one wake-up per asyncio loop (not
one per request), requests' first outputs first: see ``_deliver``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

from engine.engine_stats import EngineStats
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
# With no work, the thread checks for a stop this often.
IDLE_POLL_S = 0.05
# The longest a late launch waits between checks that the step in flight is
# still running (a CUDA event query, microseconds).
WAIT_SLICE_S = 0.002
# After handing over requests' first outputs that no forward pass made (a
# committed remote prefill's first token, handed over by the command that
# committed it, or by a step that launched nothing), the thread sleeps this
# long before its next step, so the loop it woke takes the GIL and sends them
# first: the next step's launch would otherwise hold the GIL for its whole host
# work (a decode step's: about half a millisecond on an H100) while the first
# token waits. The device runs the step in flight meanwhile, if there is one.
HANDOFF_S = 0.0002
Sink = Callable[[RequestOutput | BaseException], None]


class EngineDead(RuntimeError):
    """The engine's step failed; the node can serve nothing more."""


class EngineThread:
    def __init__(self, engine: LLMEngine, name: str = "engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future] | None] = (
            queue.SimpleQueue()
        )
        self._sinks: dict[str, Sink] = {}
        # Requests attached that have had no output yet: their next one goes first.
        self._fresh: set[str] = set()
        # Called on the engine thread after every step with that step's outputs.
        self.after_step: list[Callable[[list[RequestOutput]], None]] = []
        self.stats: EngineStats = engine.stats()
        # Times the thread let the loops take the GIL first (``HANDOFF_S``).
        self.handoffs = 0
        self.error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------- control
    def start(self) -> EngineThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def call(self, fn: Callable[[LLMEngine], T]) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps."""
        future: Future = Future()
        if self.error is not None or self._stopping:
            future.set_exception(EngineDead("the engine is not running"))
            return future
        self._commands.put((fn, future))
        return future

    def add(self, request_id: str, sink: Sink, fn: Callable[[LLMEngine], T]) -> Future:
        """Attach ``sink`` to ``request_id`` and run ``fn`` (which adds the request)."""

        def attach_and_add(engine: LLMEngine) -> T:
            self._sinks[request_id] = sink
            self._fresh.add(request_id)
            try:
                return fn(engine)
            except BaseException:
                self._drop_sink(request_id)
                raise

        return self.call(attach_and_add)

    def detach(self, request_id: str) -> None:
        self.call(lambda _: self._drop_sink(request_id))

    def _drop_sink(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._fresh.discard(request_id)

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            try:
                if not engine.has_work():
                    # Idle: commands only (what they change goes out at once).
                    self._run_commands(block=True)
                    continue
                # Late launch: until the step in flight nears its end, take the
                # requests that arrive (they join the next step). The wait is cut
                # into short slices, each rechecking whether the device finished
                # early (launch_delay is 0 then), so a step that ran faster than
                # predicted leaves the device idle for at most one slice. (Its
                # check is a CUDA event query: a device fault can surface there.)
                delay = engine.launch_delay()
                if delay > 0:
                    self._run_commands(block=True, timeout=min(delay, WAIT_SLICE_S))
                    continue
                self._run_commands(block=False)
                if self._stopping or not engine.has_work():
                    continue
                computed = engine.num_computed_tokens
                outputs = engine.step()
                launched = engine.num_computed_tokens != computed
            except BaseException as e:  # the engine's state is unknown: stop serving
                logger.exception("the engine failed; the node stops serving")
                self.error = e
                with one_wake_per_loop():
                    for sink in self._sinks.values():
                        sink(EngineDead(f"engine step failed: {e}"))
                self._sinks.clear()
                self._fresh.clear()
                return
            first = self._deliver(outputs)
            for hook in self.after_step:
                try:
                    hook(outputs)
                except Exception:
                    logger.exception("after-step hook failed")
            self.stats = engine.stats()
            if first and not launched:  # first tokens from a step that launched nothing
                self._hand_off()

    def _hand_off(self) -> None:
        """Let the loop woken for first outputs take the GIL before the next launch."""
        self.handoffs += 1
        time.sleep(HANDOFF_S)

    def _deliver(self, outputs: list[RequestOutput]) -> bool:
        """Hand outputs to their sinks; True when a request's first output was
        among them. Requests' first outputs go first: each is a time to first
        token, while the rest of the batch can wait the little the loop takes to
        turn the first ones into messages (it handles them in the order they
        come). Streams on one loop are woken once."""
        fresh = self._fresh
        first = False
        if fresh:
            outputs = sorted(outputs, key=lambda out: out.request_id not in fresh)
        with one_wake_per_loop():
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.request_id in fresh:
                    fresh.discard(out.request_id)
                    # A token, not an abort's empty ending.
                    first = first or any(c.token_ids for c in out.outputs)
                if out.finished:
                    del self._sinks[out.request_id]
                sink(out)
        return first

    def _run_commands(self, block: bool, timeout: float = IDLE_POLL_S) -> None:
        try:
            item = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        first_outputs = False
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as e:
                    result, error = None, e
                else:
                    error = None
                try:
                    # What the command changed goes out before its future
                    # resolves (a commit's first token: the loop finds it in
                    # the request's stream as it resumes from the commit, with
                    # the same wake-up). A failure here is the engine's: it
                    # propagates and stops the thread, the future resolved.
                    if outputs := self.engine.take_outputs():
                        first_outputs |= self._deliver(outputs)
                finally:
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(error)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self.engine.stats()
        if first_outputs:
            self._hand_off()


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
