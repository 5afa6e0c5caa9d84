"""The router's Prefill (router/dispatch.py) over real grpc.aio sessions on
localhost: the prefill node's servicer and session (prefill_node/session.py)
around a scripted worker (tests/unit/prefill_node/test_prefill_session.py's),
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
from pdserve.redis_server import free_port
from proto import internal_pb2
from router.dispatch import PrefillDispatcher, failed_by_prefill
from tests.unit.prefill_node.test_prefill_session import Counting, Worker, _blocks, _server

pytestmark = pytest.mark.timeout(60)

DECODE = SimpleNamespace(node_id="decode-0", tensor_parallel_size=1)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@contextlib.asynccontextmanager
async def _two_sessions(worker: Worker):
    """The router's dispatcher and a decode node's session, with one prefill node."""
    port = free_port()
    server = await _server(Counting(worker), port)
    address = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            dispatcher = PrefillDispatcher(lambda _: channel)
            decode = PrefillSessionClient(channel, "prefill-0")
            prefill = SimpleNamespace(node_id="prefill-0", address=address)
            try:
                yield dispatcher, decode, prefill
            finally:
                await dispatcher.close()
                await decode.close()
    finally:
        await server.stop(None)


def _request(rid: str, kind: int = 4, length: int = 40) -> internal_pb2.DecodeRequest:
    # Worker kind 4: waits for its blocks, replies 1000 + first_block * 10 + num_blocks.
    return internal_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=[kind] + [7] * (length - 1), traceparent="00-ab-cd-01"
    )


def test_the_routers_prefill_takes_the_decode_nodes_blocks_from_its_own_session():
    async def main():
        worker = Worker()
        async with _two_sessions(worker) as (dispatcher, decode, prefill):
            first, second = _request("a"), _request("b")
            reply = dispatcher.send(prefill, first, DECODE, 10.0)
            while "a" not in worker.started:
                await asyncio.sleep(0.01)
            rid = first.reservation_id
            await decode.send_blocks(_blocks("a", 1, 3, reservation_id=rid), 10.0)
            assert (await reply).cached_tokens == 1013
            # Blocks ahead of the router's Prefill are kept for it.
            await decode.send_blocks(_blocks("b", 0, 3, reservation_id=rid + 1), 10.0)
            assert (await dispatcher.send(prefill, second, DECODE, 10.0)).cached_tokens == 1003
            assert second.reservation_id == rid + 1  # a count, never reused
        pending = worker.pending["a"]
        assert (pending.decode_node_id, pending.decode_tp, pending.reservation_id) == (
            "decode-0",
            1,
            rid,
        )
        assert 0 < rid < 1 << 63
        assert worker.ended == []

    run(main())


def test_a_prefill_that_fails_on_the_node_fails_its_reply():
    async def main():
        worker = Worker()
        async with _two_sessions(worker) as (dispatcher, _, prefill):
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await dispatcher.send(prefill, _request("full", kind=1), DECODE, 10.0)
        assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED

    run(main())


def test_reservation_ids_are_int64s_above_zero_and_wrap():
    dispatcher = PrefillDispatcher(lambda _: None)
    dispatcher._next_id = (1 << 63) - 1
    assert [dispatcher.reservation_id() for _ in range(2)] == [(1 << 63) - 1, 1]


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
def test_a_prefills_failure_names_the_prefill_node_and_reads_retryable(code, reported):
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
