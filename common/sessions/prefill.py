"""The client end of PrefillSession: one long-lived call per prefill node,
every Prefill a message on it (prefill_node/session.py is the other end;
common/sessions/client.py the machinery shared with the router's DecodeSession).
A decode node keeps one per prefill node for the Prefills it sends; a router
with ``--prefill-dispatch router`` one for those it sends itself
(router/dispatch.py).

``PrefillSessionClient.prefill(command, timeout)`` stands for a Prefill call:
it returns the reply, or raises the ``grpc.aio.AioRpcError`` the call would
have raised: DEADLINE_EXCEEDED past ``timeout``, the prefill node's own status
for a Prefill it failed, UNAVAILABLE when the session's call ends under it (the
node died, restarted or stopped). Cancelling the task that awaits it sends a
``cancel`` command, as cancelling the call would, and so does a timeout. The
next Prefill after a loss opens a new session. A prefill node that does not
serve PrefillSession (an older release) gets a Prefill call per request.

Why: the Prefill call's two legs are on every disaggregated request's time to
first token, and a message each way on an open call costs both nodes' event
loops less than a new call (docs/performance.md, "The Prefill hop").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from common.sessions.client import CODES, OK_CODE, SessionClient, status_error
from proto import internal_pb2, internal_pb2_grpc


def start_command(req: internal_pb2.DecodeRequest) -> internal_pb2.PrefillSessionCommand:
    """A session's start command for the Prefill of ``req``: its prompt and
    sampling; the sender fills in the destination. Built in place: a
    constructor given the prompt's repeated field converts it id by id, and
    each enclosing constructor copies it again (111 against 6 us for 2048 ids
    on the VM, 0.16 ms on the GPU host)."""
    command = internal_pb2.PrefillSessionCommand()
    request = command.start.request
    request.request_id = req.request_id
    request.prompt_token_ids.extend(req.prompt_token_ids)
    request.sampling.CopyFrom(req.sampling)
    request.cache_salt = req.cache_salt
    request.resume_offset = req.resume_offset
    return command


# How long a request waits for a new session's first batch before naming its
# destination (a few milliseconds as a rule). A stalled node costs a request at
# most this before its Prefill's own timeout starts; its channel epoch then reads
# a message per header, which every prefill node sends.
LEARN_WAIT_S = 1.0


class PrefillSessionClient(SessionClient):
    """A decode node's or a router's session with one prefill node."""

    kind = "prefill node"
    call_name = "PrefillSession"
    fallback = "Prefill"

    def __init__(
        self,
        channel: grpc.aio.Channel,
        node_id: str,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(node_id, on_lost)
        self._stub = internal_pb2_grpc.PrefillNodeStub(channel)
        self._replies: dict[str, asyncio.Future] = {}  # request_id -> its reply, until it came
        # The open session's node takes Prefills whose blocks follow (its
        # first batch said so); False while none is open.
        self.blocks_follow = False
        # ... and Prefills a router sends itself (PrefillRequest.dispatched).
        self.dispatched = False
        # ... and frames KV headers as a block where asked (KVDestination.header_block).
        self.header_block = False

    async def prefill(
        self,
        command: internal_pb2.PrefillSessionCommand,
        timeout: float,
        written: asyncio.Future | None = None,
    ) -> internal_pb2.PrefillResponse:
        """The reply to ``command.start.request`` (built in the command: putting
        a finished PrefillRequest into one copies it, its prompt included).
        ``timeout`` covers everything, opening the session included, as a
        call's deadline covers connecting. ``written`` is resolved once the
        command was written. A request whose blocks follow (``send_blocks``)
        fails with UNAVAILABLE where the session no longer takes them (the
        node was replaced by an older release meanwhile)."""
        request = command.start.request
        loop = asyncio.get_running_loop()
        kind = "Prefills a router sends" if request.dispatched else "Prefills whose blocks follow"
        deadline = loop.time() + timeout
        rid = request.request_id
        reply: asyncio.Future | None = None
        try:
            if timeout <= 0:
                raise TimeoutError
            async with asyncio.timeout_at(deadline):
                opened = await self._opened()
                takes = (not request.blocks_follow or self.blocks_follow) and (
                    not request.dispatched or self.dispatched
                )
                if (request.blocks_follow or request.dispatched) and not (opened and takes):
                    raise self.lost(f"no longer takes {kind}")
                if not opened:
                    left = max(0.0, deadline - loop.time())
                    return await self._stub.Prefill(request, timeout=left)
                reply = loop.create_future()
                # Retrieved even if its awaiter is gone (no warning at exit).
                reply.add_done_callback(lambda f: f.cancelled() or f.exception())
                self._replies[rid] = reply
                command.start.timeout_s = max(0.0, deadline - loop.time())
                await self._send(command)
                if written is not None and not written.done():
                    written.set_result(None)
                return await reply
        except TimeoutError:
            if reply is not None and reply.done() and not reply.cancelled():
                return reply.result()  # it came in the very turn the deadline passed
            raise status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            if reply is not None and self._replies.pop(rid, None) is not None:
                self._send_cancel(rid)  # given up on before its reply

    def send_blocks(self, rid: str, first_block: int, num_blocks: int) -> None:
        """The reserved blocks of Prefill ``rid``, started with ``blocks_follow``
        (written after its start: one write at a time, in order)."""
        if self._call is None:
            return  # the session is gone: its reader failed the Prefill
        self._write_soon(_blocks_command(rid, first_block, num_blocks))

    async def send_dispatched_blocks(
        self, rid: str, reservation, destination: internal_pb2.KVDestination, timeout: float
    ) -> None:
        """The reserved blocks of a Prefill the router sent, with this node's KV
        channel for the prefill node and the router's reservation id
        (``destination``); opens the session if need be (UNAVAILABLE where it cannot)."""
        command = _blocks_command(rid, reservation.first_block, len(reservation.block_ids))
        command.blocks.destination.CopyFrom(destination)
        async with asyncio.timeout(max(0.0, timeout)):
            if not await self._opened():
                raise self.lost("serves no PrefillSession (an older release)")
        await self._send(command)

    async def learn(self) -> None:
        """Open the session, where none is, for up to LEARN_WAIT_S: what its node
        takes (its first batch) is then known before a Prefill's destination is
        named (the KV headers' framing). A node that does not answer is left for
        the Prefill itself to report, which waits on the same opening."""
        if self._call is not None or self.supported is False:
            return
        with contextlib.suppress(Exception):  # TimeoutError, or the opening's failure
            async with asyncio.timeout(LEARN_WAIT_S):
                await self._opened()

    # ------------------------------------------------ SessionClient's hooks
    def _new_call(self):
        return self._stub.PrefillSession()

    def _on_hello(self, hello: internal_pb2.PrefillSessionBatch | None) -> None:
        self.blocks_follow = hello is not None and hello.blocks_follow
        self.dispatched = hello is not None and hello.dispatched
        self.header_block = hello is not None and hello.header_block

    def _cancel_command(self, rid: str) -> internal_pb2.PrefillSessionCommand:
        return internal_pb2.PrefillSessionCommand(cancel=rid)

    def _on_event(self, event: internal_pb2.PrefillSessionEvent) -> None:
        reply = self._replies.pop(event.request_id, None)
        if reply is None or reply.done():
            return  # the end after its reply, or given up on here
        if event.HasField("response"):
            reply.set_result(event.response)
        elif event.end.code == OK_CODE:
            reply.set_exception(
                status_error(grpc.StatusCode.INTERNAL, "the Prefill ended with no reply")
            )
        else:
            code = CODES.get(event.end.code, grpc.StatusCode.UNKNOWN)
            reply.set_exception(status_error(code, event.end.details))

    def _fail_all(self, error: grpc.aio.AioRpcError) -> None:
        replies, self._replies = self._replies, {}
        for reply in replies.values():
            if not reply.done():
                reply.set_exception(error)


def _blocks_command(
    rid: str, first_block: int, num_blocks: int
) -> internal_pb2.PrefillSessionCommand:
    command = internal_pb2.PrefillSessionCommand()
    command.blocks.request_id = rid
    command.blocks.first_block = first_block
    command.blocks.num_blocks = num_blocks
    return command
