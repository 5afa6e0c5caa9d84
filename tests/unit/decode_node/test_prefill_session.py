"""PrefillSession end to end over a real grpc.aio server on localhost: the prefill
node's servicer (prefill_node/service.py, its session prefill_node/session.py)
around a scripted worker, and the decode node's PrefillSessionClient
(common/sessions/prefill.py) standing for Prefill calls."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.kv_transfer import TransferError
from common.kv_transfer.ticket import Destination
from common.runtime.reliability import NoCapacity
from common.sessions import prefill as prefill_session_client
from common.sessions.prefill import PrefillSessionClient
from pdserve.redis_server import free_port
from prefill_node.late_blocks import LateBlocks, LateBoard
from prefill_node.service import PrefillNodeServicer
from proto import internal_pb2, internal_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class Worker:
    """PrefillWorker.prefill's contract, scripted by the prompt's first token id:
    0 replies with first token 100 + the prompt's length; 1 is refused (the
    queue is full); 2 is a bad request; 3 hangs until cancelled; 4 (blocks
    follow) waits on a thread, as the engine's would, for the blocks and replies
    1000 + first_block * 10 + num_blocks, or raises what the wait raised."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.deadlines: dict[str, float | None] = {}
        self.lates: dict[str, LateBlocks] = {}
        self.woken: dict[str, Exception] = {}  # what woke a thread waiting for blocks
        self.requests: dict[str, internal_pb2.PrefillRequest] = {}
        # PrefillWorker's: blocks matched on any session; the streams it ended.
        self.orphaned: list[internal_pb2.KVDestination] = []
        self.board = LateBoard(self.orphaned.append)
        self.takes_dispatched = False

    def late_blocks(self, request) -> LateBlocks:
        # A router's Prefill (dispatched) sends on a channel of epoch 7.
        target = Destination("decode-0", "127.0.0.1", 1, 7) if request.dispatched else None
        late = LateBlocks(
            len(request.prompt_token_ids), 16, target, request.destination.reservation_id
        )
        self.lates[request.request_id] = late
        return late

    def _wait(self, rid: str, late: LateBlocks) -> tuple[int, int]:
        try:
            return late.wait(5)
        except Exception as e:
            self.woken[rid] = e
            raise

    async def prefill(self, request, deadline, late=None):
        rid = request.request_id
        self.started.append(rid)
        self.requests[rid] = request
        self.deadlines[rid] = deadline
        kind = request.prompt_token_ids[0]
        try:
            if kind == 1:
                raise NoCapacity("prefill node prefill-0 has no room")
            if kind == 2:
                raise ValueError("first_block 9 leaves nothing of 1 blocks to send")
            if kind == 3:
                await asyncio.Event().wait()
            if kind == 4:
                first_block, num_blocks = await asyncio.to_thread(self._wait, rid, late)
                return internal_pb2.PrefillResponse(
                    first_token_id=1000 + first_block * 10 + num_blocks
                )
            return internal_pb2.PrefillResponse(
                first_token_id=100 + len(request.prompt_token_ids), node_ms=1.5
            )
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise


class OldNode(internal_pb2_grpc.PrefillNodeServicer):
    """A prefill node of an older release: Prefill calls only."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.calls = 0

    async def Prefill(self, request, context):
        self.calls += 1
        return await self.worker.prefill(request, None)


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
    return command


def _follow(rid: str, length: int = 3) -> internal_pb2.PrefillSessionCommand:
    """A Prefill whose blocks follow (``send_blocks``), of worker kind 4."""
    command = _command(rid, kind=4, length=length)
    command.start.request.blocks_follow = True
    return command


async def _started(client, command) -> asyncio.Task:
    """A task awaiting the Prefill of ``command``, once its start was written."""
    written = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(client.prefill(command, 10.0, written))
    await written
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
        assert [r.first_token_id for r in replies] == [102 + i for i in range(6)]
        assert again.first_token_id == 109 and again.node_ms == 1.5
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
        assert "first_block 9" in bad.value.details()
        assert ok.first_token_id == 103

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
        assert ok.first_token_id == 103

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
            assert losses == [] and client.blocks_follow
            await server.stop(None)  # the node dies under its Prefill
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await waiting
            assert losses == ["lost"]
            # What the lost session said no longer holds: until one opens, the
            # decode node reserves before it sends (the next node may be older).
            assert not client.blocks_follow
            with pytest.raises(grpc.aio.AioRpcError) as down:  # nobody there to open one
                await client.prefill(_command("meanwhile"), 10.0)
            back = await _server(node, port)  # restarted on the same address
            try:
                for _ in range(50):  # the channel reconnects within its backoff
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        reply = await client.prefill(_command("after"), 10.0)
                        break
                    await asyncio.sleep(0.1)
                reopened = client.blocks_follow  # the new session said so again
            finally:
                await back.stop(None)
        assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "prefill node prefill-0" in lost.value.details()
        assert down.value.code() is grpc.StatusCode.UNAVAILABLE
        assert reply.first_token_id == 103
        assert node.sessions_opened == 2
        assert reopened

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
            assert (await client.prefill(_command("one"), 10.0)).first_token_id == 103
            assert losses == []
            await server.stop(None)
            for _ in range(200):
                if losses:
                    break
                await asyncio.sleep(0.01)

    run(main())
    assert losses == ["lost"]


def test_a_node_without_sessions_gets_prefill_calls():
    async def main():
        node = OldNode(Worker())
        async with _client_of(node) as (client, _):
            first = await client.prefill(_command("a"), 10.0)
            second = await client.prefill(_command("b", length=5), 10.0)
        assert (first.first_token_id, second.first_token_id) == (103, 105)
        assert client.supported is False and node.calls == 2

    run(main())


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
        assert ok.first_token_id == 104
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


def test_learning_what_a_node_takes_waits_a_bounded_while_and_the_prefill_the_rest(monkeypatch):
    """``learn`` opens the session before a destination is named; a node slow to
    open it costs at most LEARN_WAIT_S, then the Prefill waits on the same
    opening (no second one) and its node is known from then on."""
    monkeypatch.setattr(prefill_session_client, "LEARN_WAIT_S", 0.3)

    async def main():
        servicer = SlowToOpen(Worker())
        async with _client_of(servicer) as (client, _):
            loop = asyncio.get_running_loop()
            began = loop.time()
            await client.learn()
            assert 0.25 < loop.time() - began < 0.9
            assert client.header_block is False  # not known yet: a message per header
            reply = await client.prefill(_command("a"), 10.0)
            assert reply.first_token_id == 103 and client.header_block is True
            assert servicer.sessions_opened == 1
            began = loop.time()
            await client.learn()  # open: nothing to wait for
            assert loop.time() - began < 0.05

    run(main())


# ------------------------------------------------- Prefills whose blocks follow
def test_a_session_says_it_takes_blocks_that_follow_and_an_old_node_does_not():
    async def main():
        async with _client_of(Counting(Worker())) as (client, _):
            assert client.blocks_follow is False  # nothing known before a session opened
            assert client.header_block is False
            await client.prefill(_command("a"), 10.0)
            assert client.blocks_follow is True
            assert client.header_block is True  # it frames KV headers as a block where asked
        old = OldNode(Worker())
        async with _client_of(old) as (client, _):
            await client.prefill(_command("a"), 10.0)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.prefill(_follow("b"), 10.0)
            assert client.blocks_follow is False and client.supported is False
            assert client.header_block is False
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert old.calls == 1  # the Prefill whose blocks follow never went to it

    run(main())


def test_blocks_sent_after_the_start_reach_the_prefills_wait():
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            reply = await _started(client, _follow("b", length=40))
            client.send_blocks("b", 1, 3)  # 40 tokens are 3 blocks of 16
            assert (await reply).first_token_id == 1013
        assert worker.lates["b"].wait(0) == (1, 3)

    run(main())


def test_cancelling_a_prefill_whose_blocks_never_came_wakes_its_wait():
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            task = await _started(client, _follow("gone"))
            while "gone" not in worker.started:
                await asyncio.sleep(0.01)
            await _cancel(task, lambda: "gone" in worker.woken)
        assert worker.cancelled == ["gone"]
        # Woken by the Prefill's end, not by the wait's own 5 s.
        assert isinstance(worker.woken["gone"], TransferError)
        assert "ended before" in str(worker.woken["gone"])

    run(main())


@pytest.mark.parametrize(
    ("first_block", "num_blocks", "says"),
    [(0, 5, "reserved 5 blocks, the prompt has 1"), (1, 1, "first_block 1 leaves nothing")],
    ids=["wrong-size", "nothing-to-send"],
)
def test_blocks_that_do_not_fit_fail_the_prefill_as_a_bad_request(first_block, num_blocks, says):
    async def main():
        worker = Worker()
        async with _client_of(Counting(worker)) as (client, _):
            reply = await _started(client, _follow("bad"))
            client.send_blocks("bad", first_block, num_blocks)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await reply
            ok = await client.prefill(_command("fine"), 10.0)  # the session goes on
        assert isinstance(worker.woken["bad"], ValueError)
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert says in bad.value.details()
        assert ok.first_token_id == 103

    run(main())


def test_blocks_for_a_prefill_the_node_does_not_run_are_ignored():
    async def main():
        worker = Worker()
        node = Counting(worker)
        async with _client_of(node) as (client, _):
            await client.prefill(_command("done"), 10.0)
            client.send_blocks("done", 0, 1)  # it ended already
            client.send_blocks("nobody", 0, 1)  # never started
            ok = await client.prefill(_command("next", length=5), 10.0)
            reply = await _started(client, _follow("late"))
            client.send_blocks("late", 0, 1)
            late = await reply
        assert ok.first_token_id == 105 and late.first_token_id == 1001
        assert node.sessions_opened == 1
        assert "done" not in worker.lates and "nobody" not in worker.lates

    run(main())
