"""Runs an LLMEngine on a thread of its own: the only thread that ever touches it.

The nodes' gRPC handlers live on an asyncio loop; the engine steps on this
thread. Other threads hand it work with ``call(fn)`` (``fn(engine)`` runs
between two steps; its result or exception comes back through a Future) and
receive outputs through per-request sinks, called on this thread after each
step. ``RequestStream`` turns a sink into an async iterator on the caller's loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.engine_stats import EngineStats
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")
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
        # Called on the engine thread after every step with that step's outputs.
        self.after_step: list[Callable[[list[RequestOutput]], None]] = []
        self.stats: EngineStats = engine.stats()
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
            try:
                return fn(engine)
            except BaseException:
                self._sinks.pop(request_id, None)
                raise

        return self.call(attach_and_add)

    def detach(self, request_id: str) -> None:
        self.call(lambda _: self._sinks.pop(request_id, None))

    # ---------------------------------------------------------------- loop
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._run_commands(block=not engine.has_work())
            if self._stopping or not engine.has_work():
                continue
            try:
                outputs = engine.step()
            except BaseException as e:  # the engine's state is unknown: stop serving
                logger.exception("engine step failed; the node stops serving")
                self.error = e
                for sink in self._sinks.values():
                    sink(EngineDead(f"engine step failed: {e}"))
                self._sinks.clear()
                return
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    if out.finished:
                        del self._sinks[out.request_id]
                    sink(out)
            for hook in self.after_step:
                try:
                    hook(outputs)
                except Exception:
                    logger.exception("after-step hook failed")
            self.stats = engine.stats()

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self.engine.stats()


class RequestStream:
    """Outputs of one request, delivered from the engine thread to an asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def sink(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

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
