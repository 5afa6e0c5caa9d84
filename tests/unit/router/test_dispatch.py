"""The router's Prefill (router/dispatch.py) over real grpc.aio sessions on
localhost: the prefill node's servicer and session (prefill_node/session.py)
around a scripted worker (tests/unit/decode_node/test_prefill_session.py's),
the router's PrefillDispatcher on one session and a decode node's
PrefillSessionClient, with the blocks, on another."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import pytest

from common.runtime.reliability import FAILED_NODE_KEY
from common.sessions.prefill import PrefillSessionClient
from common.wire import FIRST_ROUTER_RESERVATION_ID
from pdserve.redis_server import free_port
from proto import internal_pb2
from router.dispatch import PrefillDispatcher, eligible, failed_by_prefill
from tests.unit.decode_node.test_prefill_session import Counting, Worker, _server

pytestmark = pytest.mark.timeout(60)

PREFILL = SimpleNamespace(node_id="prefill-0", address="", tensor_parallel_size=1)
DECODE = SimpleNamespace(node_id="decode-0")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@contextlib.asynccontextmanager
async def _two_sessions(worker: Worker):
    """The router's dispatcher and a decode node's session, with one prefill node."""
    port = free_port()
    node = Counting(worker)
    server = await _server(node, port)
    address = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            dispatcher = PrefillDispatcher(lambda _: channel)
            decode = PrefillSessionClient(channel, "prefill-0")
            try:
                yield dispatcher, decode, SimpleNamespace(**{**vars(PREFILL), "address": address})
            finally:
                await dispatcher.close()
                await decode.close()
    finally:
        await server.stop(None)


def _request(rid: str, length: int = 40) -> internal_pb2.DecodeRequest:
    # Worker kind 4: waits for its blocks, replies 1000 + first_block * 10 + num_blocks.
    return internal_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[4] + [7] * (length - 1))


def _reservation(first_block: int, num_blocks: int):
    return SimpleNamespace(first_block=first_block, block_ids=list(range(num_blocks)))


def _channel(epoch: int, reservation_id: int) -> internal_pb2.KVDestination:
    """The decode node's channel, as its blocks name it."""
    return internal_pb2.KVDestination(
        node_id="decode-0",
        store_host="127.0.0.1",
        store_port=1,
        channel_epoch=epoch,
        reservation_id=reservation_id,
    )


def test_only_a_pair_that_served_the_decode_nodes_way_gets_the_routers_prefill():
    async def main():
        worker = Worker()
        worker.takes_dispatched = True
        async with _two_sessions(worker) as (dispatcher, _, prefill):
            # The prefill node's session opens in the background on first use,
            # even while the decode node's session does not say it takes any yet.
            assert dispatcher.usable(prefill, DECODE, decode_takes=False) is None
            session = dispatcher.session(prefill)
            while not session.dispatched:
                await asyncio.sleep(0.01)
            assert dispatcher.usable(prefill, DECODE, decode_takes=True) is None  # no pair yet
            dispatcher.served("prefill-0", "decode-0")
            assert dispatcher.usable(prefill, DECODE, decode_takes=True) is session
            assert dispatcher.usable(prefill, DECODE, decode_takes=False) is None
            tp2 = SimpleNamespace(**{**vars(prefill), "tensor_parallel_size": 2})
            assert dispatcher.usable(tp2, DECODE, decode_takes=True) is None
            dispatcher.stale("prefill-0", "decode-0")
            assert dispatcher.usable(prefill, DECODE, decode_takes=True) is None

    run(main())


def test_a_node_that_takes_no_routers_prefill_gets_none():
    async def main():
        worker = Worker()
        worker.takes_dispatched = False  # tensor parallelism or --verify-kv there
        async with _two_sessions(worker) as (dispatcher, _, prefill):
            dispatcher.served("prefill-0", "decode-0")
            await dispatcher.session(prefill).open()
            assert dispatcher.usable(prefill, DECODE, decode_takes=True) is None

    run(main())


def test_the_routers_prefill_takes_the_decode_nodes_blocks_from_its_own_session():
    async def main():
        worker = Worker()
        worker.takes_dispatched = True
        async with _two_sessions(worker) as (dispatcher, decode, prefill):
            session = dispatcher.session(prefill)
            first, second = _request("a"), _request("b")
            reply = dispatcher.send(session, first, "decode-0", 10.0)
            while "a" not in worker.started:
                await asyncio.sleep(0.01)
            rid = first.prefill_reservation_id
            await decode.send_dispatched_blocks("a", _reservation(1, 3), _channel(7, rid), 10.0)
            assert (await reply).first_token_id == 1013
            # Blocks ahead of the router's Prefill are kept for it.
            await decode.send_dispatched_blocks("b", _reservation(0, 3), _channel(7, rid + 1), 10.0)
            assert (await dispatcher.send(session, second, "decode-0", 10.0)).first_token_id == 1003
            assert second.prefill_reservation_id == rid + 1  # a count, never reused
        request = worker.requests["a"]
        assert request.dispatched and request.blocks_follow and request.first_token_on_kv
        assert request.destination.node_id == "decode-0"
        assert request.destination.reservation_id == rid >= FIRST_ROUTER_RESERVATION_ID
        assert list(request.prompt_token_ids) == list(first.prompt_token_ids)

    run(main())


def test_blocks_on_another_channel_fail_the_routers_prefill_as_a_precondition():
    async def main():
        worker = Worker()
        worker.takes_dispatched = True
        async with _two_sessions(worker) as (dispatcher, decode, prefill):
            request = _request("a")
            reply = dispatcher.send(dispatcher.session(prefill), request, "decode-0", 10.0)
            while "a" not in worker.started:
                await asyncio.sleep(0.01)
            rid = request.prefill_reservation_id
            await decode.send_dispatched_blocks("a", _reservation(0, 3), _channel(8, rid), 10.0)
            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await reply
        assert stale.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "moved on" in stale.value.details()
        # The decode node expects the stream on its own channel: it ends there.
        assert [(d.channel_epoch, d.reservation_id) for d in worker.orphaned] == [(8, rid)]

    run(main())


def test_eligible_requests_are_of_one_sequence_without_logprobs():
    plain = SimpleNamespace(n=1, logprobs=None, prompt_logprobs=None)
    assert eligible(plain)
    assert not eligible(SimpleNamespace(**{**vars(plain), "n": 2}))
    assert not eligible(SimpleNamespace(**{**vars(plain), "logprobs": 0}))
    assert not eligible(SimpleNamespace(**{**vars(plain), "prompt_logprobs": 1}))


@pytest.mark.parametrize(
    ("code", "reported"),
    [
        (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE),
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_a_prefills_failure_reads_as_the_decode_nodes_own_would(code, reported):
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "it broke")
    failed = failed_by_prefill(error, "prefill-0")
    assert failed.code() is reported
    assert failed.details() == "prefill node prefill-0: it broke"
    assert dict(failed.trailing_metadata())[FAILED_NODE_KEY] == "prefill-0"
    # A session's own failure names the node already.
    lost = grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(), "prefill node prefill-0: Stream removed"
    )
    assert (
        failed_by_prefill(lost, "prefill-0").details() == "prefill node prefill-0: Stream removed"
    )
    assert failed_by_prefill(RuntimeError("x"), "prefill-0").code() is grpc.StatusCode.UNAVAILABLE
