"""DecodeSession end to end over a real grpc.aio server on localhost: the node's
session (decode_node/session.py) around a scripted worker, and the router's
NodeSession/SessionCall (router/node_session.py) reading each request as a call of its own."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.runtime.reliability import FAILED_NODE_KEY
from common.version import PROTOCOL_VERSION
from decode_node.remote_prefill import PrefillFailed
from decode_node.session import DecodeSession
from pdserve.redis_server import free_port
from proto import internal_pb2, internal_pb2_grpc, pdserve_pb2
from router.node_session import NodeSession, SessionCall

pytestmark = pytest.mark.timeout(60)


class Worker:
    """DecodeWorker.decode's contract, scripted by the prompt's first token id:
    0 streams ``n`` tokens in one-token messages, one per ``step``; 1 fails
    with a prefill node's failure; 2 with a bad request; 3 hangs forever."""

    def __init__(self, step: asyncio.Event | None = None) -> None:
        self.step = step
        self.closed: list[str] = []  # requests whose stream was closed early
        self.deadlines: dict[str, float | None] = {}
        self.node_id = "decode-0"

    async def decode(self, request, deadline):
        rid = request.request_id
        self.deadlines[rid] = deadline
        kind = request.prompt_token_ids[0]
        try:
            if kind == 1:
                raise PrefillFailed("prefill-7", grpc.StatusCode.UNAVAILABLE, "it died")
            if kind == 2:
                raise ValueError("temperature must be >= 0")
            if kind == 3:
                await asyncio.Event().wait()
            n = request.sampling.max_tokens
            for i in range(n):
                if self.step is not None:
                    await self.step.wait()
                response = pdserve_pb2.GenerateResponse(request_id=rid)
                response.deltas.add(index=0, token_ids=[100 + i])
                yield response
        except BaseException:
            self.closed.append(rid)
            raise


class Node(internal_pb2_grpc.DecodeNodeServicer):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.sessions_opened = 0
        self.batches = 0

    async def DecodeSession(self, request_iterator, context):
        await DecodeSession.check_version(context, "decode node decode-0")
        self.sessions_opened += 1
        async for batch in DecodeSession(self.worker).run(request_iterator):
            self.batches += 1
            yield batch


class OtherVersion(Node):
    async def DecodeSession(self, request_iterator, context):
        yield internal_pb2.SessionBatch(protocol_version=PROTOCOL_VERSION + 1)
        await asyncio.Event().wait()


async def _server(node: Node, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    internal_pb2_grpc.add_DecodeNodeServicer_to_server(node, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


@contextlib.asynccontextmanager
async def _session_with(node: Node):
    """A NodeSession with ``node`` serving on a port of its own."""
    port = free_port()
    server = await _server(node, port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            session = NodeSession(channel, "decode-0")
            try:
                yield session
            finally:
                await session.close()
    finally:
        await server.stop(None)


def _request(rid: str, kind: int = 0, tokens: int = 3) -> internal_pb2.SessionCommand:
    """The start command of a request (NodeSession.start takes the request built in it)."""
    command = internal_pb2.SessionCommand()
    request = command.start.request
    request.request_id = rid
    request.prompt_token_ids.extend([kind, 5, 6])
    request.sampling.max_tokens = tokens
    return command


async def _tokens(call) -> list[int]:
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.extend(message.deltas[0].token_ids)
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_many_requests_share_one_call_and_a_step_is_one_batch():
    async def main():
        step = asyncio.Event()
        node = Node(Worker(step))
        async with _session_with(node) as session:
            calls = [await session.start(_request(f"r{i}", tokens=4), None) for i in range(8)]
            assert all(isinstance(c, SessionCall) for c in calls)
            readers = [asyncio.ensure_future(_tokens(c)) for c in calls]
            for _ in range(4):  # four "engine steps", each releasing every request's token
                await asyncio.sleep(0.05)
                step.set()
                await asyncio.sleep(0)
                step.clear()
            step.set()
            results = await asyncio.gather(*readers)
        assert results == [[100, 101, 102, 103]] * 8
        assert node.sessions_opened == 1
        # 32 messages and 8 ends, released in 4 steps (and the opening empty
        # batch): far fewer batches than messages.
        assert node.batches <= 9, node.batches

    run(main())


def test_failures_read_as_the_requests_status():
    async def main():
        async with _session_with(Node(Worker())) as session:
            failed = await session.start(_request("p", kind=1), None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _tokens(failed)
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "it died" in e.value.details()
            assert dict(e.value.trailing_metadata())[FAILED_NODE_KEY] == "prefill-7"
            bad = await session.start(_request("b", kind=2), None)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _tokens(bad)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "temperature" in e.value.details()
            # The session outlives its requests' failures.
            ok = await session.start(_request("ok"), None)
            assert await _tokens(ok) == [100, 101, 102]

    run(main())


def test_cancel_aborts_the_request_on_the_node_and_its_read():
    async def main():
        worker = Worker()
        async with _session_with(Node(worker)) as session:
            hung = await session.start(_request("h", kind=3), None)
            reading = asyncio.ensure_future(hung.read())
            await asyncio.sleep(0.1)
            assert hung.cancel() is True
            with pytest.raises(asyncio.CancelledError):
                await reading
            for _ in range(100):
                if "h" in worker.closed:
                    break
                await asyncio.sleep(0.01)
            assert worker.closed == ["h"]
            assert hung.cancel() is False  # once only
            ok = await session.start(_request("ok"), None)
            assert await _tokens(ok) == [100, 101, 102]
            assert ok.cancel() is False  # ended: nothing to cancel

    run(main())


def test_a_request_past_its_deadline_ends_with_deadline_exceeded():
    async def main():
        worker = Worker()
        async with _session_with(Node(worker)) as session:
            hung = await session.start(_request("h", kind=3), 0.2)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _tokens(hung)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert worker.deadlines["h"] is not None
            assert worker.closed == ["h"]

    run(main())


def test_a_lost_session_fails_its_requests_unavailable_and_the_next_reopens():
    async def main():
        port = free_port()
        servers = [await _server(Node(Worker()), port)]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                session = NodeSession(channel, "decode-0")
                hung = await session.start(_request("h", kind=3), None)
                await asyncio.sleep(0.1)
                await servers[0].stop(None)  # the node goes away under the request
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _tokens(hung)
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE
                assert "decode-0" in e.value.details()
                node2 = Node(Worker())
                servers.append(await _server(node2, port))  # back, on the same address
                for _ in range(50):  # the channel reconnects (its backoff is short)
                    call = await session.start(_request("again"), None)
                    try:
                        assert await _tokens(call) == [100, 101, 102]
                        break
                    except grpc.aio.AioRpcError as err:
                        assert err.code() is grpc.StatusCode.UNAVAILABLE
                        await asyncio.sleep(0.1)
                else:
                    pytest.fail("no session after the node came back")
                assert node2.sessions_opened == 1
                await session.close()
        finally:
            for server in servers:
                await server.stop(None)

    run(main())


def test_a_node_of_another_version_fails_the_request_naming_both_versions():
    async def main():
        async with _session_with(OtherVersion(Worker())) as session:
            call = await session.start(_request("a"), None)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _tokens(call)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert f"protocol version {PROTOCOL_VERSION + 1}" in refused.value.details()
        assert f"this process {PROTOCOL_VERSION}" in refused.value.details()

    run(main())


def test_the_relay_reads_a_session_call_merged_and_finds_a_stalled_node():
    from router.relay import node_messages

    async def main():
        step = asyncio.Event()
        worker = Worker(step)
        async with _session_with(Node(worker)) as session:
            call = await session.start(_request("r", tokens=6), None)
            step.set()  # every token at once: they queue up behind the first
            got = []
            async for response in node_messages(call, "decode-0", _alive):
                got.append(list(response.deltas[0].token_ids))
                await asyncio.sleep(0.05)  # a slow client: the rest arrive meanwhile
            assert [t for tokens in got for t in tokens] == [100, 101, 102, 103, 104, 105]
            assert len(got) < 6  # merged while the relay was busy
            # A node that stops answering mid-stream: the watch gives up on it.
            hung = await session.start(_request("h", kind=3), None)
            first_of_hung = asyncio.ensure_future(
                _first(node_messages(hung, "decode-0", _dead, silence_s=0.2))
            )
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await first_of_hung
            assert e.value.code() is grpc.StatusCode.UNAVAILABLE
            for _ in range(100):
                if "h" in worker.closed:
                    break
                await asyncio.sleep(0.01)
            assert "h" in worker.closed  # cancelled on the node too

    run(main())


async def _alive() -> bool:
    return True


async def _dead() -> bool:
    return False


async def _first(messages):
    async for message in messages:
        return message


def test_failing_a_request_ends_it_with_the_error_until_the_node_answered():
    # router/dispatch.py: a Prefill the router sent failed. Before the node's
    # first message the request ends with that error and is cancelled on the
    # node; after it, the stream stands.
    async def main():
        step = asyncio.Event()
        worker = Worker(step)
        async with _session_with(Node(worker)) as session:
            hung = await session.start(_request("hung", kind=3), None)
            answered = await session.start(_request("answered", tokens=3), None)
            step.set()
            first = await answered.read()  # its first message is here
            step.clear()
            error = grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata((FAILED_NODE_KEY, "prefill-0")),
                "prefill node prefill-0: it died",
            )
            hung.fail(error)
            answered.fail(error)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await hung.read()
            while "hung" not in worker.closed:  # cancelled on the node too
                await asyncio.sleep(0.01)
            step.set()
            rest = await _tokens(answered)
        assert failed.value is error
        assert list(first.deltas[0].token_ids) + rest == [100, 101, 102]

    run(main())
