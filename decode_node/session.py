"""A router's DecodeSession on a decode node: many requests over one call.

Life of a session: a router opens one DecodeSession per decode node and keeps
it. Each request comes as a ``start`` command and runs here as its own task,
the very ``DecodeWorker.decode`` a Decode call runs; what it yields goes into
the session's outbox instead of onto a call of its own. The session's one
writer sends everything in the outbox as ONE batch whenever it gets the loop:
the engine thread hands a step's outputs over together, every request's task
turns its output into messages in that same loop turn, and so one engine step
becomes one message to the router instead of one per request. A request ends
with an ``end`` event carrying the status its Decode call would have ended
with (and the failed prefill node's id, Decode's trailing metadata). A
``cancel`` command aborts one request (its client left); the call ending,
from either side, aborts every request still on it.

Why: a message on an open call costs both ends a fraction of a new call, and
every gRPC message costs the node's event loop CPU that its engine thread,
sharing the GIL, waits for: per token, the session does that work once per
step instead of once per request (benchmarks/router_relay.py measures both
ways, ``--compare-node-streams``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from common.grpc_server import status_of
from decode_node.worker import DecodeWorker, PrefillFailed
from proto import internal_pb2

# A batch stops growing here (the rest goes in the next): it keeps a message
# far below gRPC's size limit even when the router falls behind.
MAX_EVENTS_PER_BATCH = 1024


class DecodeSession:
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker
        self._outbox: list[internal_pb2.SessionEvent] = []
        self._ready = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}

    async def run(
        self, commands: AsyncIterator[internal_pb2.SessionCommand]
    ) -> AsyncIterator[internal_pb2.SessionBatch]:
        """The batches to send, until the router closes its side and every request ended."""
        # An empty batch at once: the router writes nothing before it (router/node_session.py).
        yield internal_pb2.SessionBatch()
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
                yield internal_pb2.SessionBatch(events=events)
        finally:
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            # The requests' own cleanup (engine aborts) runs before the call ends.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, commands: AsyncIterator[internal_pb2.SessionCommand]) -> None:
        try:
            async for command in commands:
                which = command.WhichOneof("command")
                if which == "start":
                    self._start(command.start)
                elif which == "cancel":
                    self._cancel(command.cancel)
        finally:
            self._ready.set()  # the writer checks whether it is all over

    def _start(self, start: internal_pb2.SessionStart) -> None:
        rid = start.request.request_id
        if rid in self._tasks:  # ids are the router's uuid4s: a repeat is a bug there
            self._push(_end(rid, grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is running"))
            return
        timeout = start.timeout_s if start.HasField("timeout_s") else None
        self._tasks[rid] = asyncio.ensure_future(self._one(start.request, timeout))

    def _cancel(self, rid: str) -> None:
        # Popped here: a task cancelled before it first ran never reaches its finally.
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def _one(self, request: internal_pb2.DecodeRequest, timeout_s: float | None) -> None:
        rid = request.request_id
        # The worker takes time.monotonic() deadlines (uvloop's loop.time() is another clock).
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        me = asyncio.current_task()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            me.cancel()

        loop = asyncio.get_running_loop()
        timer = None if timeout_s is None else loop.call_later(timeout_s, expire)
        end = _end(rid, grpc.StatusCode.OK, "")
        try:
            async for response in self.worker.decode(request, deadline):
                self._push(internal_pb2.SessionEvent(request_id=rid, response=response))
        except asyncio.CancelledError:
            if not expired:
                return  # cancelled by the router, or the session ends: nobody to tell
            end = _end(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        except PrefillFailed as e:
            # Nothing reached the client: the router retries on another prefill
            # node, avoiding the one named here.
            end = _end(rid, e.status_code, str(e), e.node_id)
        except Exception as e:
            end = _end(rid, *status_of(e))
        finally:
            if timer is not None:
                timer.cancel()
            self._tasks.pop(rid, None)
        self._push(end)

    def _push(self, event: internal_pb2.SessionEvent) -> None:
        self._outbox.append(event)
        self._ready.set()


def _end(
    rid: str, code: grpc.StatusCode, details: str, failed_node: str = ""
) -> internal_pb2.SessionEvent:
    return internal_pb2.SessionEvent(
        request_id=rid,
        end=internal_pb2.SessionEnd(code=code.value[0], details=details, failed_node=failed_node),
    )
