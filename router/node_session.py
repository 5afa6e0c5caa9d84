"""The router's end of DecodeSession: one long-lived call per decode node, every
request to that node a message on it (decode_node/session.py is the other end).

Life of a request here: ``NodeSession.start`` writes the request's ``start``
command on the node's session (opening the session first if it has none) and
returns a ``SessionCall``, which router/relay.py reads like a server-streaming
call: ``read()`` gives the request's messages, then ``grpc.aio.EOF``, or raises
a ``grpc.aio.AioRpcError`` with the request's end status (the failed prefill
node in its trailing metadata, as the node names it in the end event);
``cancel()`` sends a ``cancel`` command. The session's one reader task takes
each batch off the call and hands every event to its request.

When the session's call ends under its requests (the node died, restarted or
stopped), each of them fails with UNAVAILABLE: the router retries or migrates
it as usual, and the next request opens a new session. Opening one waits for
the node's first batch (its protocol version) before anything is written.

The machinery (opening, writes, cancels, the reader, the loss) is
common/sessions/client.py's, shared with the decode node's PrefillSession.

Why sessions: a request's start is one message on an open call instead of a
new call (the router's hop to the node costs a fraction), and a node sends one
message per engine step for all of a router's requests instead of one per
request, which is most of a node's and a router's per-token work
(benchmarks/router_relay.py measures both).
"""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from common.runtime.reliability import FAILED_NODE_KEY
from common.sessions.client import CODES, OK_CODE, VERSION_METADATA, SessionClient, status_error
from proto import internal_pb2, internal_pb2_grpc


class SessionCall:
    """One request on a node's session, read like a call of its own."""

    __slots__ = (
        "_answered",
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
        self._answered = False  # a response of the node's arrived
        self._sink = None  # subscribe()'s callback

    async def read(self):
        while not self._items:
            if self._cancelled:
                raise asyncio.CancelledError
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter  # a cancel() cancels it: CancelledError, as a call's read
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        """Abort the request on the node (a no-op once it ended)."""
        if self._ended or self._cancelled:
            return False
        self._cancelled = True
        self._session._cancel(self.request.request_id)
        self._wake()
        return True

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """End the request here with ``error`` and cancel it on the node (the
        Prefill the router sent for it failed: router/dispatch.py); a no-op
        once it ended or the node answered (its first token came: the stream
        stands, as a decode node's does where its Prefill fails after the token)."""
        if self._ended or self._cancelled or self._answered:
            return
        self._session._cancel(self.request.request_id)
        self._end(error)

    def subscribe(self, sink) -> None:
        """From now on hand each item (a response, then EOF or the error) to
        ``sink(item)`` as it arrives, instead of keeping it for read(): the
        relay's own queue, one task wake less per message."""
        self._sink = sink
        while self._items:
            sink(self._items.popleft())

    # ------------------------------------------------ from the session's reader
    def _deliver(self, item) -> None:
        self._answered = True
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


class NodeSession(SessionClient):
    """The router's session with one decode node (opened on first use, reopened after a loss)."""

    kind = "decode node"

    def __init__(self, channel: grpc.aio.Channel, node_id: str) -> None:
        super().__init__(node_id)
        self._stub = internal_pb2_grpc.DecodeNodeStub(channel)
        self._calls: dict[str, SessionCall] = {}

    async def start(self, command: internal_pb2.SessionCommand, timeout: float | None):
        """The stream of ``command.start.request`` as a SessionCall. The request
        is built in the command: putting a finished DecodeRequest into one
        copies it, its prompt's ids included."""
        request = command.start.request
        call = SessionCall(self, request)
        try:
            await self._opened()
        except grpc.aio.AioRpcError as e:  # the node did not answer, or refused the session
            call._end(e)
            return call
        self._calls[request.request_id] = call
        if timeout is not None:
            command.start.timeout_s = timeout
        await self._send(command)
        return call

    @property
    def in_flight(self) -> int:
        """This router's requests on the node now (their streams not ended)."""
        return len(self._calls)

    def _cancel(self, rid: str) -> None:
        if self._calls.pop(rid, None) is not None:
            self._send_cancel(rid)

    # ------------------------------------------------ SessionClient's hooks
    def _new_call(self):
        return self._stub.DecodeSession(metadata=VERSION_METADATA)

    def _cancel_command(self, rid: str) -> internal_pb2.SessionCommand:
        return internal_pb2.SessionCommand(cancel=rid)

    def _on_event(self, event: internal_pb2.SessionEvent) -> None:
        call = self._calls.get(event.request_id)
        if call is None:
            return  # cancelled here meanwhile
        if event.HasField("response"):
            call._deliver(event.response)
        else:
            del self._calls[event.request_id]
            call._end(_ending(event.end))

    def _fail_all(self, error: grpc.aio.AioRpcError) -> None:
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call._end(error)


def _ending(end: internal_pb2.SessionEnd):
    """A request's end event as what a call's read gives: EOF, or its error."""
    if end.code == OK_CODE:
        return grpc.aio.EOF
    trailing = ((FAILED_NODE_KEY, end.failed_node),) if end.failed_node else ()
    return status_error(CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.details, trailing)
