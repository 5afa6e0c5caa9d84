"""router/relay.py: messages that queued up while the router was busy leave as
one (order kept, the Final from the last), alone otherwise, never while a
migration seam asks for them apart; a silent stream whose node does not answer
fails UNAVAILABLE; the call's own error passes through."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc
import pytest

from proto import pdserve_pb2
from router.relay import merge, node_messages


def message(tokens: list[int], text: str, final: bool = False, index: int = 0):
    m = pdserve_pb2.GenerateResponse(request_id="r")
    d = m.deltas.add(index=index, text=text)
    d.token_ids.extend(tokens)
    for t in tokens:
        d.logprobs.add(token_id=t, logprob=-float(t))
    if final:
        m.final.usage.completion_tokens = 99
    return m


def test_merge_keeps_order_per_index_and_takes_the_last_final():
    out = merge(
        [
            message([1], "a"),
            message([7], "x", index=1),
            message([2, 3], "bc"),
            message([4], "d", final=True),
        ]
    )
    by = {d.index: d for d in out.deltas}
    assert list(by[0].token_ids) == [1, 2, 3, 4] and by[0].text == "abcd"
    assert [lp.token_id for lp in by[0].logprobs] == [1, 2, 3, 4]
    assert list(by[1].token_ids) == [7] and by[1].text == "x"
    assert out.HasField("final") and out.final.usage.completion_tokens == 99


class FakeCall:
    """A request on a session (router/node_session.py's SessionCall), fed by the
    test: read() gives what came before ``subscribe``, the sink what comes
    after; cancel() ends a pending read with CancelledError."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.sink = None
        self.cancelled = False

    def put(self, item) -> None:
        if self.sink is not None:
            self.sink(item)
            return
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def read(self):
        while not self.items:
            if self.cancelled:
                raise asyncio.CancelledError()
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        item = self.items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def subscribe(self, sink) -> None:
        self.sink = sink
        while self.items:
            sink(self.items.popleft())

    def cancel(self) -> None:
        self.cancelled = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.cancel()


async def alive() -> bool:
    return True


def test_alone_while_keeping_up_merged_when_behind_apart_when_asked():
    async def go():
        call = FakeCall()
        coalesce = [True]
        got = []
        stream = node_messages(call, "d0", alive, coalesce=lambda: coalesce[0])
        call.put(message([1], "a"))
        got.append(await stream.__anext__())  # one queued: it leaves alone
        for t in (2, 3, 4):
            call.put(message([t], str(t)))
        await asyncio.sleep(0.01)  # the session queued all three meanwhile
        got.append(await stream.__anext__())
        coalesce[0] = False
        for t in (5, 6):
            call.put(message([t], str(t)))
        await asyncio.sleep(0.01)
        got.append(await stream.__anext__())
        got.append(await stream.__anext__())
        call.put(grpc.aio.EOF)
        rest = [m async for m in stream]
        return got, rest

    got, rest = asyncio.run(go())
    assert [list(m.deltas[0].token_ids) for m in got] == [[1], [2, 3, 4], [5], [6]]
    assert rest == []


def test_a_silent_stream_on_a_dead_node_fails_unavailable():
    async def go():
        call = FakeCall()

        async def dead() -> bool:
            return False

        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in node_messages(call, "d7", dead, silence_s=0.05):
                pass
        return call, info.value

    call, err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode node d7 stopped answering" in err.details()
    assert call.cancelled


def test_a_silent_stream_on_a_live_node_keeps_waiting():
    async def go():
        call = FakeCall()
        probes = []

        async def live() -> bool:
            probes.append(1)
            return True

        async def later():
            await asyncio.sleep(0.2)
            call.put(message([9], "z", final=True))
            call.put(grpc.aio.EOF)

        feeder = asyncio.ensure_future(later())
        out = [m async for m in node_messages(call, "d1", live, silence_s=0.05)]
        await feeder
        return out, probes

    out, probes = asyncio.run(go())
    assert [list(m.deltas[0].token_ids) for m in out] == [[9]]
    assert len(probes) >= 2  # probed while silent, and the stream went on


def test_the_calls_own_error_passes_through():
    async def go():
        call = FakeCall()
        boom = grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details="boom"
        )
        call.put(message([1], "a"))
        call.put(boom)
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for m in node_messages(call, "d2", alive):
                seen.append(m)
        return seen, info.value

    seen, err = asyncio.run(go())
    assert err.code() == grpc.StatusCode.INTERNAL
    assert [list(m.deltas[0].token_ids) for m in seen] == [[1]]


def test_a_node_that_stalls_after_its_first_message_fails_unavailable():
    async def go():
        call = FakeCall()

        async def dead() -> bool:
            return False

        call.put(message([1], "a"))
        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for m in node_messages(call, "d8", dead, silence_s=0.05):
                seen.append(m)
        return seen, info.value

    seen, err = asyncio.run(go())
    assert [list(m.deltas[0].token_ids) for m in seen] == [[1]]
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_a_caller_that_goes_away_before_the_first_message_is_cancelled_not_failed():
    async def go():
        call = FakeCall()

        async def consume():
            async for _ in node_messages(call, "d9", alive):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
