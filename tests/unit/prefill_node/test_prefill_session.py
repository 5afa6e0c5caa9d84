"""PrefillSession end to end over a real grpc.aio server on localhost: the prefill
node's servicer (prefill_node/service.py, its session prefill_node/session.py)
around a scripted worker with the node's real DestinationBoard, a router's
PrefillSessionClient sending Prefills (common/sessions/prefill.py) and a
decode node's sending their blocks on a session of its own."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.kv_transfer import TransferError
from common.runtime.reliability import NoCapacity
from common.sessions.prefill import PrefillSessionClient
from common.version import PROTOCOL_VERSION, VERSION_KEY
from pdserve.redis_server import free_port
from prefill_node import destinations
from prefill_node.destinations import DestinationBoard, PendingDestination
from prefill_node.service import PrefillNodeServicer
from proto import internal_pb2, internal_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class Worker:
    """PrefillWorker.prefill's contract, scripted by the prompt's first token id:
    0 replies with cached_tokens 100 + the prompt's length; 1 is refused (the
    queue is full); 2 is a bad request; 3 hangs until cancelled; 4 waits on a
    thread, as the engine's would, for the decode node's blocks and replies
    cached_tokens 1000 + first_block * 10 + num_blocks, or raises what the wait raised."""

    def __init__(self) -> None:
        self.node_id = "prefill-0"
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.deadlines: dict[str, float | None] = {}
        self.pending: dict[str, PendingDestination] = {}
        self.woken: dict[str, Exception] = {}  # what woke a thread waiting for blocks
        # The streams the board ended (the decode node's channel epoch, the reservation).
        self.ended: list[tuple[int, int]] = []
        self.board = DestinationBoard(lambda d, rid: self.ended.append((d.epoch, rid)))

    def pending_destination(self, request) -> PendingDestination:
        pending = self.pending[request.request_id] = PendingDestination(request, 16)
        return pending

    def _wait(self, rid: str, pending: PendingDestination) -> PendingDestination:
        try:
            pending.wait(5)
        except Exception as e:
            self.woken[rid] = e
            raise
        return pending

    async def prefill(self, request, deadline, pending):
        rid = request.request_id
        self.started.append(rid)
        self.deadlines[rid] = deadline
        kind = request.prompt_token_ids[0]
        try:
            if kind == 1:
                raise NoCapacity("prefill node prefill-0 has no room")
            if kind == 2:
                raise ValueError("a Prefill needs its decode node's id")
            if kind == 3:
                await asyncio.Event().wait()
            if kind == 4:
                got = await asyncio.to_thread(self._wait, rid, pending)
                return internal_pb2.PrefillResponse(
                    cached_tokens=1000 + got.first_block * 10 + got.num_blocks
                )
            return internal_pb2.PrefillResponse(
                cached_tokens=100 + len(request.prompt_token_ids), node_ms=1.5
            )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


class Counting(PrefillNodeServicer):
    def __init__(self, worker) -> None:
        super().__init__(worker)
        self.sessions_opened = 0

    async def PrefillSession(self, request_iterator, context):
        self.sessions_opened += 1
        async for batch in super().PrefillSession(request_iterator, context):
            yield batch


async def _server(servicer, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    internal_pb2_grpc.add_PrefillNodeServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


@contextlib.asynccontextmanager
async def _client_of(servicer, port: int | None = None, on_lost=None):
    port = port or free_port()
    server = await _server(servicer, port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = PrefillSessionClient(channel, "prefill-0", on_lost=on_lost)
            try:
                yield client, server
            finally:
                await client.close()
    finally:
        await server.stop(None)


def _command(rid: str, kind: int = 0, length: int = 3) -> internal_pb2.PrefillSessionCommand:
    command = internal_pb2.PrefillSessionCommand()
    request = command.start.request
    request.request_id = rid
    request.prompt_token_ids.extend([kind] + [7] * (length - 1))
    request.decode_node_id = "decode-0"
    request.reservation_id = 5
    return command


def _follow(rid: str, length: int = 3) -> internal_pb2.PrefillSessionCommand:
    """A Prefill that waits for its decode node's blocks (worker kind 4)."""
    return _command(rid, kind=4, length=length)


def _blocks(rid: str, first: int, num: int, epoch: int = 7, **fields) -> internal_pb2.PrefillBlocks:
    """A decode node's blocks for reservation 5 of decode-0, on its channel of ``epoch``."""
    blocks = internal_pb2.PrefillBlocks(
        request_id=rid, reservation_id=5, first_block=first, num_blocks=num
    )
    channel = blocks.channel
    channel.node_id, channel.store_host, channel.store_port = "decode-0", "127.0.0.1", 5000
    channel.epoch, channel.tensor_parallel_size = epoch, 1
    for name, value in fields.items():
        setattr(blocks, name, value) if hasattr(blocks, name) else setattr(channel, name, value)
    return blocks


async def _started(client, command, worker) -> asyncio.Task:
    """A task awaiting the Prefill of ``command``, once the node runs it."""
    task = asyncio.ensure_future(client.prefill(command, 10.0))
    rid = command.start.request.request_id
    while rid not in worker.started:
        await asyncio.sleep(0.01)
    return task


async def _cancel(task: asyncio.Task, seen) -> None:
    """Cancel the task awaiting a Prefill, then give the node up to 2 s until ``seen()``."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if seen():
            break
        await asyncio.sleep(0.02)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_prefills_share_one_session_and_get_their_own_replies():
    async def main():
        worker = Worker()
        node = Counting(worker)
        async with _client_of(node) as (client, _):
            replies = await asyncio.gather(
                *(client.prefill(_command(f"r{i}", length=2 + i), 10.0) for i in range(6))
            )
            again = await client.prefill(_command("later", length=9), 10.0)
        assert [r.cached_tokens for r in replies] == [102 + i for i in range(6)]
        assert again.cached_tokens == 109 and again.node_ms == 1.5
        assert node.sessions_opened == 1
        # The node's deadline is the command's timeout from when it read it.
        assert all(d is not None for d in worker.deadlines.values())

    run(main())


def test_a_failed_prefill_raises_the_status_its_call_would_have():
    async def main():
        async with _client_of(Counting(Worker())) as (client, _):
            with pytest.raises(grpc.aio.AioRpcError) as full:
                await client.prefill(_command("full", kind=1), 10.0)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client.prefill(_command("bad", kind=2), 10.0)
            ok = await client.prefill(_command("fine"), 10.0)  # the session goes on
        assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no room" in full.value.details()
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "decode node's id" in bad.value.details()
        assert ok.cached_tokens == 103

    run(main())


def test_a_timeout_is_deadline_exceeded_here_and_cancels_the_prefill_there():
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.prefill(_command("slow", kind=3), 0.3)
            for _ in range(100):
                if "slow" in worker.cancelled:
                    break
                await asyncio.sleep(0.02)
            ok = await client.prefill(_command("next"), 10.0)
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert worker.cancelled == ["slow"]
        assert ok.cached_tokens == 103

    run(main())


def test_cancelling_the_waiting_task_cancels_the_prefill_on_the_node():
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            task = asyncio.ensure_future(client.prefill(_command("gone", kind=3), 10.0))
            while "gone" not in worker.started:
                await asyncio.sleep(0.01)
            await _cancel(task, lambda: "gone" in worker.cancelled)
        assert worker.cancelled == ["gone"]

    run(main())


def test_a_lost_node_fails_its_prefills_unavailable_and_a_new_session_opens_after():
    losses: list[str] = []  # the decode node resets its KV channels with the node on each

    async def main():
        worker = Worker()
        node = Counting(worker)
        port = free_port()
        async with _client_of(node, port, on_lost=lambda: losses.append("lost")) as (
            client,
            server,
        ):
            waiting = asyncio.ensure_future(client.prefill(_command("stuck", kind=3), 10.0))
            while "stuck" not in worker.started:
                await asyncio.sleep(0.01)
            assert losses == []
            await server.stop(None)  # the node dies under its Prefill
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await waiting
            assert losses == ["lost"]
            with pytest.raises(grpc.aio.AioRpcError) as down:  # nobody there to open one
                await client.prefill(_command("meanwhile"), 10.0)
            back = await _server(node, port)  # restarted on the same address
            try:
                for _ in range(50):  # the channel reconnects within its backoff
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        reply = await client.prefill(_command("after"), 10.0)
                        break
                    await asyncio.sleep(0.1)
            finally:
                await back.stop(None)
        assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "prefill node prefill-0" in lost.value.details()
        assert down.value.code() is grpc.StatusCode.UNAVAILABLE
        assert reply.cached_tokens == 103
        assert node.sessions_opened == 2

    run(main())
    # The second session ended too, when the test stopped its node.
    assert losses == ["lost", "lost"]


def test_a_session_lost_with_no_prefill_on_it_is_reported():
    """A node that dies idle breaks no Prefill, only the session: the decode
    node learns it from this call alone (and moves its KV channels with the
    node to a new epoch before a restarted node's first transfer)."""
    losses: list[str] = []

    async def main():
        async with _client_of(Counting(Worker()), on_lost=lambda: losses.append("lost")) as (
            client,
            server,
        ):
            assert (await client.prefill(_command("one"), 10.0)).cached_tokens == 103
            assert losses == []
            await server.stop(None)
            for _ in range(200):
                if losses:
                    break
                await asyncio.sleep(0.01)

    run(main())
    assert losses == ["lost"]


def test_giving_up_on_a_prefill_while_it_is_written_leaves_the_session_to_the_others():
    """grpc.aio cancels a whole call when one of its writes is cancelled: a
    Prefill given up on (cancelled, or a deadline already passed) must not
    take the session, and every Prefill on it, down with it."""

    async def main():
        worker = Worker()
        node = Counting(worker)
        async with _client_of(node) as (client, _):
            await client.prefill(_command("open"), 10.0)
            waiting = asyncio.ensure_future(client.prefill(_command("long", kind=3), 10.0))
            while "long" not in worker.started:
                await asyncio.sleep(0.01)
            for i in range(5):  # cancelled while its start command is being written
                task = asyncio.ensure_future(client.prefill(_command(f"c{i}", kind=3), 10.0))
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            with pytest.raises(grpc.aio.AioRpcError) as late:  # its deadline already passed
                await client.prefill(_command("late"), 0.0)
            ok = await client.prefill(_command("after", length=4), 10.0)
            still_waiting = not waiting.done()
            waiting.cancel()
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "late" not in worker.started  # nothing was sent for it
        assert ok.cached_tokens == 104
        assert still_waiting and node.sessions_opened == 1

    run(main())


class SlowToOpen(Counting):
    async def PrefillSession(self, request_iterator, context):
        await asyncio.sleep(1.0)  # a node too busy to open the session at once
        async for batch in super().PrefillSession(request_iterator, context):
            yield batch


def test_the_timeout_covers_opening_the_session():
    async def main():
        async with _client_of(SlowToOpen(Worker())) as (client, _):
            began = asyncio.get_running_loop().time()
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await client.prefill(_command("a"), 0.3)
            took = asyncio.get_running_loop().time() - began
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert took < 0.9, f"the open took the Prefill {took:.2f} s past its 0.3 s"

    run(main())


# ------------------------------------------------------- protocol versions
class OtherVersion(Counting):
    """A node that speaks another protocol version (its first batch says so)."""

    async def PrefillSession(self, request_iterator, context):
        yield internal_pb2.PrefillSessionBatch(protocol_version=PROTOCOL_VERSION + 1)
        await asyncio.Event().wait()


def test_a_node_of_another_version_fails_the_prefill_naming_both_versions():
    async def main():
        async with _client_of(OtherVersion(Worker())) as (client, _):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.prefill(_command("a"), 10.0)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        details = refused.value.details()
        assert f"protocol version {PROTOCOL_VERSION + 1}" in details
        assert f"this process {PROTOCOL_VERSION}" in details

    run(main())


@pytest.mark.parametrize("sent", [None, str(PROTOCOL_VERSION + 1)], ids=["none", "newer"])
def test_the_node_refuses_a_caller_of_another_version_naming_both(sent):
    async def main():
        worker = Worker()
        port = free_port()
        server = await _server(Counting(worker), port)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                metadata = () if sent is None else ((VERSION_KEY, sent),)
                call = internal_pb2_grpc.PrefillNodeStub(channel).PrefillSession(metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
        finally:
            await server.stop(None)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        said = "no protocol version" if sent is None else f"protocol version {sent}"
        assert said in refused.value.details()
        assert f"this process {PROTOCOL_VERSION}" in refused.value.details()
        assert "prefill node prefill-0" in refused.value.details()
        assert worker.started == []

    run(main())


# ------------------------------------------- the decode node's blocks
def test_blocks_from_another_session_reach_the_prefills_wait():
    """The router's session brings the Prefill, the decode node's its blocks."""

    async def main():
        worker = Worker()
        node = Counting(worker)
        port = free_port()
        async with (
            _client_of(node, port) as (router, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
        ):
            decode = PrefillSessionClient(channel, "prefill-0")
            try:
                reply = await _started(router, _follow("b", length=40), worker)
                await decode.send_blocks(_blocks("b", 1, 3), 5.0)  # 40 tokens: 3 blocks
                got = await reply
            finally:
                await decode.close()
        assert got.cached_tokens == 1013
        dest = worker.pending["b"].destination
        assert (dest.node_id, dest.store_port, dest.epoch) == ("decode-0", 5000, 7)
        assert node.sessions_opened == 2 and worker.ended == []

    run(main())


def test_blocks_that_come_before_their_prefill_are_kept_for_it():
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            await client.send_blocks(_blocks("early", 2, 3), 5.0)
            reply = await client.prefill(_follow("early", length=40), 10.0)
        assert reply.cached_tokens == 1023 and worker.ended == []

    run(main())


def test_blocks_whose_prefill_never_comes_end_their_stream_after_a_while(monkeypatch):
    monkeypatch.setattr(destinations, "WAIT_S", 0.2)

    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            await client.send_blocks(_blocks("nobody", 0, 1, epoch=9), 5.0)
            for _ in range(100):
                if worker.ended:
                    break
                await asyncio.sleep(0.02)
        # The decode node expects the reservation's stream: it ends on the blocks' channel.
        assert worker.ended == [(9, 5)]

    run(main())


def test_cancelling_a_prefill_whose_blocks_never_came_wakes_its_wait():
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            task = await _started(client, _follow("gone"), worker)
            await _cancel(task, lambda: "gone" in worker.woken)
        assert worker.cancelled == ["gone"]
        # Woken by the Prefill's end, not by the wait's own 5 s.
        assert isinstance(worker.woken["gone"], TransferError)
        assert "ended before" in str(worker.woken["gone"])

    run(main())


@pytest.mark.parametrize(
    ("first_block", "num_blocks", "fields", "says"),
    [
        (0, 5, {}, "reserved 5 blocks, the prompt has 1"),
        (1, 1, {}, "first_block 1 leaves nothing"),
        (0, 1, {"reservation_id": 6}, "name reservation 6, the Prefill 5"),
        (0, 1, {"node_id": "decode-1"}, "for a Prefill bound for decode-0"),
        (0, 1, {"tensor_parallel_size": 2}, "the Prefill says 1"),
    ],
    ids=["wrong-size", "nothing-to-send", "other-reservation", "other-node", "other-size"],
)
def test_blocks_that_do_not_fit_fail_the_prefill_and_end_its_stream(
    first_block, num_blocks, fields, says
):
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            reply = await _started(client, _follow("bad"), worker)
            await client.send_blocks(_blocks("bad", first_block, num_blocks, **fields), 5.0)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await reply
            ok = await client.prefill(_command("fine"), 10.0)  # the session goes on
        assert isinstance(worker.woken["bad"], ValueError)
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert says in bad.value.details()
        assert ok.cached_tokens == 103
        # The decode node expects the stream on the channel its blocks name: it ends there.
        assert worker.ended == [(7, 6 if "reservation_id" in fields else 5)]

    run(main())


def test_blocks_for_a_prefill_that_ended_end_its_stream_after_a_while(monkeypatch):
    """Blocks that come after their Prefill ended (it failed, or was cancelled)
    find no Prefill: the decode node expects the stream all the same, so the
    board ends it, once the time a Prefill may take to come is over."""
    monkeypatch.setattr(destinations, "WAIT_S", 0.2)

    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            await client.prefill(_command("done"), 10.0)
            await client.send_blocks(_blocks("done", 0, 1), 5.0)
            ok = await client.prefill(_command("next", length=5), 10.0)
            for _ in range(100):
                if worker.ended:
                    break
                await asyncio.sleep(0.02)
        assert ok.cached_tokens == 105
        assert worker.ended == [(7, 5)]

    run(main())
