"""Runs an LLMEngine on a thread of its own, the one thread that steps it.

The nodes' gRPC handlers live on an asyncio loop; the engine steps on this
thread. Other threads hand it work with ``call(fn)`` (``fn(engine)`` runs
between two steps; its result or exception comes back through a Future) and
receive outputs through per-request sinks, called under the engine's lock
after each step and each command. ``RequestStream`` (engine/request_stream.py)
turns a sink into an async iterator on the caller's loop.

One thread at a time touches the engine: the engine thread holds ``_lock``
except while it waits for work. A caller may ask for a command to run on its
own thread (``call(fn, inline=True)``): it does when the engine thread is
idle, waiting, with no command queued before it, else the command is queued as
usual. Why: a round trip through an idle engine thread is two hand-overs
between threads (wake it, then wake the caller's loop), each a measurable part
of a request's time to first token, twice on every disaggregated request's (the
decode node's reservation and its commit;
docs/lab/2026-11-27-prefill-hop-same-gpu-baseline.md).

A step's outputs go to their streams with one wake-up per asyncio loop (not
one per request), requests' first outputs first: see ``_deliver``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.engine_stats import EngineStats
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request_stream import one_wake_per_loop

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
# work while the first token waits (docs/lab/2026-11-26-layer-wise-kv-streaming.md).
# The device runs the step in flight meanwhile, if there is one.
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
        # Held by whichever thread touches the engine (module docstring).
        self._lock = threading.Lock()
        # The engine thread waits for commands with the engine idle (no work).
        self._idle = False
        # Commands put and not run yet (one taken off the queue included), so
        # that an inline command never runs before one queued earlier.
        self._queued = 0
        self._queued_lock = threading.Lock()
        # Commands callers ran themselves (``call(fn, inline=True)``).
        self.inline_calls = 0
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

    def call(self, fn: Callable[[LLMEngine], T], inline: bool = False) -> Future:
        """Run ``fn(engine)`` on the engine thread between steps; ``inline``: on
        this thread, now, if the engine thread is idle with nothing queued (the
        future is then resolved on return, and outputs ``fn`` made are handed
        over from here)."""
        future: Future = Future()
        if self.error is not None or self._stopping:
            future.set_exception(EngineDead("the engine is not running"))
            return future
        if inline and self._run_inline(fn, future):
            return future
        self._put((fn, future))
        return future

    def add(
        self, request_id: str, sink: Sink, fn: Callable[[LLMEngine], T], inline: bool = False
    ) -> Future:
        """Attach ``sink`` to ``request_id`` and run ``fn`` (which adds the request)."""

        def attach_and_add(engine: LLMEngine) -> T:
            self._sinks[request_id] = sink
            self._fresh.add(request_id)
            try:
                return fn(engine)
            except BaseException:
                self._drop_sink(request_id)
                raise

        return self.call(attach_and_add, inline)

    def detach(self, request_id: str) -> None:
        self.call(lambda _: self._drop_sink(request_id))

    def _drop_sink(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self._fresh.discard(request_id)

    def _put(self, item: tuple[Callable[[LLMEngine], Any], Future]) -> None:
        with self._queued_lock:
            self._queued += 1
        self._commands.put(item)

    @property
    def idle(self) -> bool:
        """The engine thread waits for work with nothing queued: a command
        asked for inline now would run on the caller's thread (unless the
        thread wakes meanwhile)."""
        return self._idle and not self._queued and self.error is None

    def _run_inline(self, fn: Callable[[LLMEngine], Any], future: Future) -> bool:
        """Run a command on the calling thread if the engine thread is idle and
        nothing was queued before it; False (nothing done) otherwise."""
        if not self._idle or not self._lock.acquire(blocking=False):
            return False
        try:
            # Under the lock: the engine thread is still waiting (it takes the
            # lock before it runs what it was woken for) and owes nothing.
            if not self.idle or self._stopping:
                return False
            future.set_running_or_notify_cancel()
            first = False
            try:
                first = self._execute(fn, future)
            except BaseException as e:  # handing over outputs failed: the engine's
                self._die(e, "handing over a command's outputs failed")
            else:
                self.stats = self.engine.stats()
            self.inline_calls += 1
            wake = self.error is not None or self.engine.has_work()
        finally:
            self._lock.release()
        if wake:  # it has a step to run (or a failure to stop on)
            # After first outputs, the thread lets the caller's loop send them
            # before it launches that step, as after a command of its own.
            self._put((_handed_over_first if first else _no_op, Future()))
        return True

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        with self._lock:
            try:
                self._loop()
            finally:
                # Whatever is still queued never runs: its callers hear so now.
                while True:
                    try:
                        item = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        self._refuse(item[1])

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping and self.error is None:
            try:
                if not engine.has_work():
                    # Idle: commands only (what they change goes out at once),
                    # or callers run theirs themselves meanwhile.
                    self._run_commands(block=True, idle=True)
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
                self._die(e, "engine step failed")
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

    def _die(self, error: BaseException, what: str) -> None:
        """The engine's state is unknown: every stream fails, nothing more runs."""
        logger.error("%s; the node stops serving", what, exc_info=error)
        self.error = error
        with one_wake_per_loop():
            for sink in self._sinks.values():
                sink(EngineDead(f"{what}: {error}"))
        self._sinks.clear()
        self._fresh.clear()

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

    def _run_commands(self, block: bool, timeout: float | None = None, idle: bool = False) -> None:
        """Run the queued commands; ``block``: wait up to ``timeout`` (default
        ``IDLE_POLL_S``) for the first, and with ``idle`` let callers run
        theirs inline meanwhile."""
        timeout = IDLE_POLL_S if timeout is None else timeout
        try:
            if not block:
                item = self._commands.get_nowait()
            elif not idle:
                item = self._commands.get(timeout=timeout)
            else:
                self._idle = True
                self._lock.release()
                try:
                    item = self._commands.get(timeout=timeout)
                finally:
                    self._lock.acquire()
                    self._idle = False
        except queue.Empty:
            return
        first_outputs = False
        while item is not None:
            fn, future = item
            try:
                if self.error is not None:  # an inline command's hand-over failed
                    self._refuse(future)
                elif fn is _handed_over_first:
                    first_outputs = True
                    future.set_result(None)
                elif future.set_running_or_notify_cancel():
                    first_outputs |= self._execute(fn, future)
            finally:
                with self._queued_lock:
                    self._queued -= 1
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self.engine.stats()
        if first_outputs:
            self._hand_off()

    @staticmethod
    def _refuse(future: Future) -> None:
        if future.set_running_or_notify_cancel():
            future.set_exception(EngineDead("the engine is not running"))

    def _execute(self, fn: Callable[[LLMEngine], Any], future: Future) -> bool:
        """Run one command and resolve its future; True when it handed over a
        request's first output."""
        try:
            result = fn(self.engine)
        except BaseException as e:
            result, error = None, e
        else:
            error = None
        try:
            # What the command changed goes out before its future resolves (a
            # commit's first token: the loop finds it in the request's stream
            # as it resumes from the commit, with the same wake-up). A failure
            # here is the engine's: it propagates (and stops the engine), the
            # future resolved.
            outputs = self.engine.take_outputs()
            return self._deliver(outputs) if outputs else False
        finally:
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


def _no_op(engine: LLMEngine) -> None:
    """Wakes the engine thread (for a step an inline command made due)."""


def _handed_over_first(engine: LLMEngine) -> None:
    """Wakes the engine thread for a step an inline command made due, after
    that command handed over first outputs (the thread hands off first)."""
