"""The router's end of DecodeSession: one long-lived call per decode node, every
request to that node a message on it (decode_node/session.py is the other end).

Life of a request here: ``NodeSession.start`` writes the request's ``start``
command on the node's session (opening the session first if it has none) and
returns a ``SessionCall``, which router/relay.py reads exactly like a Decode
call: ``read()`` gives the request's messages, then ``grpc.aio.EOF``, or raises
the ``grpc.aio.AioRpcError`` its Decode call would have raised (the failed
prefill node in its trailing metadata, as the node puts it there);
``cancel()`` sends a ``cancel`` command. The session's one reader task takes
each batch off the call and hands every event to its request.

When the session's call ends under its requests (the node died, restarted or
stopped), each of them fails with UNAVAILABLE, as its own call would have:
the router retries or migrates it as usual, and the next request opens a new
session. Opening one waits for the node's first (empty) batch before anything
is written. A node that does not serve DecodeSession (an older release)
answers UNIMPLEMENTED instead: its requests, those waiting for that answer
included, then use Decode calls, the way a router did before sessions.

Why sessions: a request's start is one message on an open call instead of a
new call (the router's hop to the node costs a fraction), and a node sends one
message per engine step for all of a router's requests instead of one per
request, which is most of a node's and a router's per-token work
(benchmarks/router_relay.py measures both).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque

import grpc

from common.reliability import FAILED_NODE_KEY
from proto import internal_pb2, internal_pb2_grpc

logger = logging.getLogger(__name__)


class NodeStreams(enum.Enum):
    """How the router streams requests from decode nodes (--node-streams)."""

    SESSION = "session"  # many requests over one DecodeSession per node
    CALL = "call"  # one Decode call per request

    def __str__(self) -> str:  # argparse shows choices by str()
        return self.value


# A command a session's node does not take within this long (gRPC's flow-control
# window full: the node stopped reading) drops the session; its requests fail
# with UNAVAILABLE and are retried or migrated (router/relay.py's silence watch
# finds such a node the same way for a stream that is already running).
WRITE_TIMEOUT_S = 2.0

_OK = grpc.StatusCode.OK.value[0]
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SessionCall:
    """One request on a node's session, read like its own Decode call."""

    __slots__ = (
        "_cancelled",
        "_ended",
        "_items",
        "_session",
        "_sink",
        "_waiter",
        "request",
    )

    def __init__(self, session: NodeSession, request: internal_pb2.DecodeRequest) -> None:
        self._session = session
        self.request = request
        self._items: deque = deque()  # responses, then EOF or an error
        self._waiter: asyncio.Future | None = None
        self._ended = False  # its end (or the session's) arrived
        self._cancelled = False
        self._sink = None  # subscribe()'s callback

    async def read(self):
        while not self._items:
            if self._cancelled:
                raise asyncio.CancelledError
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter  # a cancel() cancels it: CancelledError, as a Decode call's read
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        """Abort the request on the node (a no-op once it ended), as a Decode call's cancel."""
        if self._ended or self._cancelled:
            return False
        self._cancelled = True
        self._session._cancel(self.request.request_id)
        self._wake()
        return True

    def subscribe(self, sink) -> None:
        """From now on hand each item (a response, then EOF or the error) to
        ``sink(item)`` as it arrives, instead of keeping it for read(): the
        relay's own queue, one task wake less per message."""
        self._sink = sink
        while self._items:
            sink(self._items.popleft())

    # ------------------------------------------------ from the session's reader
    def _deliver(self, item) -> None:
        if self._sink is not None:
            self._sink(item)
            return
        self._items.append(item)
        self._wake()

    def _end(self, item) -> None:
        self._ended = True
        self._deliver(item)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if self._cancelled:
                waiter.cancel()
            else:
                waiter.set_result(None)


class NodeSession:
    """The router's session with one decode node (opened on first use, reopened after a loss)."""

    def __init__(self, channel: grpc.aio.Channel, node_id: str) -> None:
        self.node_id = node_id
        self._stub = internal_pb2_grpc.DecodeNodeStub(channel)
        self._call = None
        self._reader: asyncio.Future | None = None
        self._opening: asyncio.Future | None = None
        self._open_error: grpc.aio.AioRpcError | None = None  # why the last open failed
        self._calls: dict[str, SessionCall] = {}
        self._write_lock = asyncio.Lock()  # grpc.aio takes one write at a time on a call
        self._cancels: set[asyncio.Future] = set()
        self._why = "its session was cancelled"  # what a cancelled session's requests are told
        self.supported: bool | None = None  # None: not known yet (no session opened so far)

    async def start(self, command: internal_pb2.SessionCommand, timeout: float | None):
        """The stream of ``command.start.request``: a SessionCall, or a Decode call
        where the node has no sessions. The request is built in the command
        (``command.start.request``): putting a finished DecodeRequest into one
        copies it, its prompt's ids included."""
        request = command.start.request
        if self._call is None and self.supported is not False:
            await self._open()
        if self.supported is False:
            return self._stub.Decode(request, timeout=timeout)
        call = SessionCall(self, request)
        if self._call is None:  # the node did not answer: what its own call would have said
            call._end(self._open_error or _lost(self.node_id, "no session"))
            return call
        self._calls[request.request_id] = call
        if timeout is not None:
            command.start.timeout_s = timeout
        await self._write(command)
        return call

    async def close(self) -> None:
        self._why = "the router closed its session"
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _open(self) -> None:
        """Open a session, once for every request that asks meanwhile."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._handshake())
            self._opening.add_done_callback(lambda _: setattr(self, "_opening", None))
        await asyncio.shield(self._opening)

    async def _handshake(self) -> None:
        # The node's first batch is an empty one, sent at once: nothing is
        # written before it arrives, because a command written while the node
        # refuses the call (an older release: UNIMPLEMENTED) turns the call's
        # status into the transport's INTERNAL and hides the refusal.
        call = self._stub.DecodeSession()
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                hello = await call.read()
        except TimeoutError:
            call.cancel()
            self._open_error = _lost(self.node_id, "did not open a session in time")
            return
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                logger.info(
                    "decode node %s does not serve DecodeSession (an older release): "
                    "one Decode call per request to it",
                    self.node_id,
                )
                self.supported = False
                return
            self._open_error = _lost(self.node_id, e.details() or e.code().name)
            return
        if hello is grpc.aio.EOF:
            self._open_error = _lost(self.node_id, "ended its session at once")
            return
        self.supported = True
        self._open_error = None
        self._call = call
        self._reader = asyncio.ensure_future(self._read(call))

    async def _write(self, command: internal_pb2.SessionCommand) -> None:
        session = self._call
        try:
            # Bounded: a stalled node stops taking writes once gRPC's flow-control
            # window is full, and a request must not wait on it with no end.
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                async with self._write_lock:
                    await session.write(command)
        except TimeoutError:
            logger.warning(
                "decode node %s took no command for %.0f s: its session is dropped",
                self.node_id,
                WRITE_TIMEOUT_S,
            )
            self._why = f"took no command for {WRITE_TIMEOUT_S:.0f} s"
            session.cancel()  # its reader fails every request on it, this one too
        except Exception as e:  # the session ended under us: its reader fails the requests
            logger.debug("decode node %s: a write on its session failed: %s", self.node_id, e)

    def _cancel(self, rid: str) -> None:
        if self._calls.pop(rid, None) is not None and self._call is not None:
            command = internal_pb2.SessionCommand(cancel=rid)
            task = asyncio.ensure_future(self._write(command))
            self._cancels.add(task)  # held until written (the loop keeps weak references only)
            task.add_done_callback(self._cancels.discard)

    async def _read(self, session) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            while (batch := await session.read()) is not grpc.aio.EOF:
                for event in batch.events:
                    call = self._calls.get(event.request_id)
                    if call is None:
                        continue  # cancelled here meanwhile
                    if event.HasField("response"):
                        call._deliver(event.response)
                    else:
                        del self._calls[event.request_id]
                        call._end(_ending(event.end))
            error = _lost(self.node_id, "ended the session")
        except grpc.aio.AioRpcError as e:
            error = _lost(self.node_id, e.details() or e.code().name)
        except asyncio.CancelledError:
            error = _lost(self.node_id, self._why)
            raise
        finally:
            if self._call is session:
                self._call = None
            calls, self._calls = self._calls, {}
            if error is not None:
                for call in calls.values():
                    call._end(error)


def _ending(end: internal_pb2.SessionEnd):
    """A request's end event as what its Decode call's read would give: EOF, or its error."""
    if end.code == _OK:
        return grpc.aio.EOF
    trailing = ((FAILED_NODE_KEY, end.failed_node),) if end.failed_node else ()
    return grpc.aio.AioRpcError(
        _CODES.get(end.code, grpc.StatusCode.UNKNOWN),
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*trailing),
        details=end.details,
    )


def _lost(node_id: str, why: str) -> grpc.aio.AioRpcError:
    # UNAVAILABLE, as the transport would have said to each request's own call:
    # the router retries (nothing received) or migrates the request.
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"decode node {node_id}: {why}",
    )
