"""Reading a decode node's stream for the router: a silence watch, and coalescing.

Life of one Decode stream here: a reader task takes the node's messages off the
call as they come and queues them (a request on a DecodeSession needs no task:
the session's reader hands its messages straight to that queue, see
router/node_session.py); the relay takes everything queued at once
and hands it on as ONE message (``merge``); a watch task wakes once a second
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

The first message is read by the relay itself, and the reader task starts
after it: through the task it took one more event-loop turn (the reader's
wake-up, then the relay's) on its way to the client's first token. A stall
before it is handled the same way: the watch cancels the call, which ends the
pending read with CancelledError.
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
    call,
    node_id: str,
    responsive: Callable[[], Awaitable[bool]],
    coalesce: Callable[[], bool] = lambda: True,
    silence_s: float = SILENCE_CHECK_S,
) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """The call's messages, merged while they queue up (when ``coalesce()``).
    Raises grpc.aio.AioRpcError: the call's own, or UNAVAILABLE when the stream
    went silent and the node did not answer ``responsive()``."""
    loop = asyncio.get_running_loop()
    queued: deque = deque()
    arrived = asyncio.Event()
    last = loop.time()
    ended = False
    error: BaseException | None = None
    stalled = False

    async def read() -> None:
        nonlocal last, ended, error
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                queued.append(message)
                last = loop.time()
                arrived.set()
        except BaseException as e:  # the call's failure (or our cancel): the relay raises it
            error = e
        finally:
            ended = True
            arrived.set()

    def deliver(item) -> None:
        """A session's item, handed over by its reader (no task of ours in between)."""
        nonlocal last, ended, error
        if item is grpc.aio.EOF:
            ended = True
        elif isinstance(item, BaseException):
            error, ended = item, True
        else:
            queued.append(item)
            last = loop.time()
        arrived.set()

    async def watch() -> None:
        nonlocal stalled
        while not ended:
            quiet = loop.time() - last
            if quiet < silence_s:
                await asyncio.sleep(silence_s - quiet)
                continue
            if not await responsive():
                stalled = True
                call.cancel()
                if reader is not None:
                    reader.cancel()
                elif subscribed:
                    deliver(grpc.aio.EOF)  # nothing more comes: the relay raises below
                return
            await asyncio.sleep(silence_s)

    reader: asyncio.Future | None = None
    subscribed = False
    watcher = asyncio.ensure_future(watch())
    try:
        try:
            first = await call.read()
        except asyncio.CancelledError:
            # The watch cancelled the call (and nobody cancelled us): the node stalled.
            if stalled and not asyncio.current_task().cancelling():
                raise _stalled(node_id) from None
            raise
        if first is grpc.aio.EOF:
            return
        last = loop.time()
        yield first
        if isinstance(call, SessionCall):
            # The session's reader hands this request's messages straight over.
            subscribed = True
            call.subscribe(deliver)
        else:
            reader = asyncio.ensure_future(read())
        while True:
            if not queued:
                if ended:
                    break
                arrived.clear()
                await arrived.wait()
                continue
            if len(queued) == 1 or not coalesce():
                yield queued.popleft()
            else:
                batch = list(queued)
                queued.clear()
                yield merge(batch)
        if stalled:
            raise _stalled(node_id)
        if error is not None:
            raise error
    finally:
        tasks = [t for t in (reader, watcher) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def _stalled(node_id: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"decode node {node_id} stopped answering mid-request",
    )
