"""The serving end of a session: many requests over one long-lived bidi call.

A session's client (a router for DecodeSession, a decode node for
PrefillSession) keeps one call open per node. Each request comes up as a
``start`` command and runs here as its own task, the very handler its own call
would run; what it produces goes into the session's outbox instead of onto a
call of its own. The session's one writer sends everything in the outbox as ONE
batch whenever it gets the loop, so that what several requests produce in one
loop turn (one engine step's outputs, usually) is one message. A request ends
with an ``end`` event carrying the status its own call would have ended with. A
``cancel`` command aborts one request (its client gave up); the call ending,
from either side, aborts every request still on it.

Why: a message on an open call costs both ends a fraction of a new call, and
every gRPC message costs the node's event loop CPU that its engine thread,
sharing the GIL, waits for.

Subclasses say what a request is (``handle``) and how its end is written
(``end_event``; ``failure_event`` for a status of its own); the command and batch messages share
one shape: ``start.request.request_id``, ``start.timeout_s``, ``cancel``, and
a batch's ``events``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from common.grpc_server import status_of
from common.version import PROTOCOL_VERSION, mismatch, version_of

# A batch stops growing here (the rest goes in the next): it keeps a message
# far below gRPC's size limit even when the client falls behind.
MAX_EVENTS_PER_BATCH = 1024


class RequestSession:
    #: The batch message (its repeated field is ``events``).
    batch_type: Any = None

    def __init__(self) -> None:
        self._outbox: list = []
        self._ready = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}

    # ----------------------------------------------------- for subclasses
    def handle(self, request, deadline: float | None) -> AsyncIterator:
        """The request's events, in order, until it succeeded (raises on a failure)."""
        raise NotImplementedError

    def end_event(self, rid: str, code: grpc.StatusCode, details: str):
        """The event that ends request ``rid`` with this status."""
        raise NotImplementedError

    def failure_event(self, rid: str, error: Exception):
        """The end of a request whose handler raised ``error``: the status its own call would get."""
        return self.end_event(rid, *status_of(error))

    def hello(self):
        """The first batch, sent at once: the node's protocol version."""
        return self.batch_type(protocol_version=PROTOCOL_VERSION)

    def other_command(self, which: str, command) -> None:
        """A command other than start and cancel (``which`` is its oneof name)."""

    # ------------------------------------------------------------ the call
    @staticmethod
    async def check_version(context: grpc.aio.ServicerContext, node: str) -> None:
        """Refuse a client of another protocol version (FAILED_PRECONDITION,
        naming both) before anything else happens on the call."""
        theirs = version_of(context.invocation_metadata())
        why = mismatch(PROTOCOL_VERSION, theirs, "the caller")
        if why is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{node}: {why}")

    async def run(self, commands: AsyncIterator) -> AsyncIterator:
        """The batches to send, until the client closes its side and every request ended."""
        # The first batch at once: the client writes nothing before it (a node
        # that refuses the call says so instead).
        yield self.hello()
        reader = asyncio.ensure_future(self._read(commands))
        try:
            while True:
                if not self._outbox:
                    if reader.done():
                        reader.result()  # the command stream's failure, if any
                        if not self._tasks:
                            return
                    self._ready.clear()
                    await self._ready.wait()
                    continue
                events = self._outbox[:MAX_EVENTS_PER_BATCH]
                del self._outbox[:MAX_EVENTS_PER_BATCH]
                yield self.batch_type(events=events)
        finally:
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            # The requests' own cleanup (engine aborts) runs before the call ends.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, commands: AsyncIterator) -> None:
        try:
            async for command in commands:
                which = command.WhichOneof("command")
                if which == "start":
                    self._start(command.start)
                elif which == "cancel":
                    self._cancel(command.cancel)
                elif which is not None:
                    self.other_command(which, command)
        finally:
            self._ready.set()  # the writer checks whether it is all over

    def _start(self, start) -> asyncio.Task | None:
        """The request's task, or None when it was refused."""
        rid = start.request.request_id
        if rid in self._tasks:  # ids are uuid4s: a repeat is a bug on the client
            self.push(
                self.end_event(rid, grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is running")
            )
            return None
        timeout = start.timeout_s if start.HasField("timeout_s") else None
        task = self._tasks[rid] = asyncio.ensure_future(self._one(start.request, timeout))
        return task

    def _cancel(self, rid: str) -> None:
        # Popped here: a task cancelled before it first ran never reaches its finally.
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def _one(self, request, timeout_s: float | None) -> None:
        rid = request.request_id
        # Handlers take time.monotonic() deadlines (uvloop's loop.time() is another clock).
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        me = asyncio.current_task()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            me.cancel()

        loop = asyncio.get_running_loop()
        timer = None if timeout_s is None else loop.call_later(timeout_s, expire)
        end = self.end_event(rid, grpc.StatusCode.OK, "")
        try:
            async for event in self.handle(request, deadline):
                self.push(event)
        except asyncio.CancelledError:
            if not expired:
                return  # cancelled by the client, or the session ends: nobody to tell
            end = self.end_event(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        except Exception as e:
            end = self.failure_event(rid, e)
        finally:
            if timer is not None:
                timer.cancel()
            if self._tasks.get(rid) is me:  # a later start of the same id is not ours
                del self._tasks[rid]
        self.push(end)

    def push(self, event) -> None:
        self._outbox.append(event)
        self._ready.set()
