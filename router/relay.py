"""Reading a decode node's stream for the router: a silence watch, and coalescing.

Life of one request's stream here: the relay reads its first message itself;
after it the session's reader hands the request's messages straight to the
relay's queue (``SessionCall.subscribe``, router/node_session.py: no task of
the relay's in between); the relay takes everything queued at once and hands
it on as ONE message (``merge``); a watch task wakes once a second
and, when the stream has been silent that long, asks the node whether it is
alive (``responsive``), failing the stream with UNAVAILABLE if it does not
answer (a SIGSTOPped process keeps its connection open, so the transport never
notices).

Why coalesce: every gRPC message costs the router a read and a write, each
about what a bare gRPC server spends on the message (benchmarks/router_relay.py
measures both), and the Python work of the relay comes on top. While the
router keeps up, each node message goes out alone, as before (one per engine
step). When it falls behind, the messages that arrived meanwhile leave as one,
so a busy router sends fewer, larger messages instead of queueing ever more
work; vLLM's API server merges a request's outputs the same way when its
client side is slower than the engine. Merged deltas keep their order: text
concatenated, token ids and logprobs appended, the Final from the last.

Why a watch task rather than a timeout on every read: a timed wait per message
is a task, a timer and a future per token; the watch is one sleeping task per
stream and a timestamp per message.

A stall before the first message is handled the same way: the watch cancels
the call, which ends the pending read with CancelledError.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from proto import pdserve_pb2
from router.node_session import SessionCall

# A stream silent this long has its decode node probed.
SILENCE_CHECK_S = 1.0


def merge(responses: list[pdserve_pb2.GenerateResponse]) -> pdserve_pb2.GenerateResponse:
    """Several consecutive messages of one stream as one (the first, extended in place)."""
    out = responses[0]
    if len(responses) == 1:
        return out
    by_index = {d.index: d for d in out.deltas}
    for response in responses[1:]:
        for delta in response.deltas:
            mine = by_index.get(delta.index)
            if mine is None:
                mine = by_index[delta.index] = out.deltas.add(index=delta.index)
            mine.text += delta.text
            mine.token_ids.extend(delta.token_ids)
            mine.logprobs.extend(delta.logprobs)
        if response.HasField("final"):
            out.final.CopyFrom(response.final)
    return out


async def node_messages(
    call: SessionCall,
    node_id: str,
    responsive: Callable[[], Awaitable[bool]],
    coalesce: Callable[[], bool] = lambda: True,
    silence_s: float = SILENCE_CHECK_S,
) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """The call's messages, merged while they queue up (when ``coalesce()``).
    Raises grpc.aio.AioRpcError: the call's own, or UNAVAILABLE when the stream
    went silent and the node did not answer ``responsive()``."""
    relay = _Relay(call, asyncio.get_running_loop())
    watcher = asyncio.ensure_future(relay.watch(responsive, silence_s))
    try:
        try:
            first = await call.read()
        except asyncio.CancelledError:
            # The watch cancelled the call (and nobody cancelled us): the node stalled.
            if relay.stalled and not asyncio.current_task().cancelling():
                raise _stalled(node_id) from None
            raise
        if first is grpc.aio.EOF:
            return
        relay.last = relay.loop.time()
        yield first
        relay.subscribed = True
        call.subscribe(relay.deliver)  # the session's reader hands the rest over
        while True:
            if not relay.queued:
                if relay.ended:
                    break
                relay.arrived.clear()
                await relay.arrived.wait()
                continue
            if len(relay.queued) == 1 or not coalesce():
                yield relay.queued.popleft()
            else:
                batch = list(relay.queued)
                relay.queued.clear()
                yield merge(batch)
        if relay.stalled:
            raise _stalled(node_id)
        if relay.error is not None:
            raise relay.error
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher


class _Relay:
    """One stream's queue, as its session's reader fills it, and its silence watch."""

    def __init__(self, call: SessionCall, loop: asyncio.AbstractEventLoop) -> None:
        self.call = call
        self.loop = loop
        self.queued: deque = deque()
        self.arrived = asyncio.Event()
        self.last = loop.time()  # when the last message came
        self.ended = False
        self.error: BaseException | None = None
        self.stalled = False
        self.subscribed = False

    def deliver(self, item) -> None:
        """A session's item, handed over by its reader (no task in between)."""
        if item is grpc.aio.EOF:
            self.ended = True
        elif isinstance(item, BaseException):
            self.error, self.ended = item, True
        else:
            self.queued.append(item)
            self.last = self.loop.time()
        self.arrived.set()

    async def watch(self, responsive, silence_s: float) -> None:
        while not self.ended:
            quiet = self.loop.time() - self.last
            if quiet < silence_s:
                await asyncio.sleep(silence_s - quiet)
                continue
            if not await responsive():
                self.stalled = True
                self.call.cancel()
                if self.subscribed:
                    self.deliver(grpc.aio.EOF)  # nothing more comes: the relay raises
                return
            await asyncio.sleep(silence_s)


def _stalled(node_id: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"decode node {node_id} stopped answering mid-request",
    )
