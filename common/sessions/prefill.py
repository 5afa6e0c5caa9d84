"""The client end of PrefillSession: one long-lived call per prefill node
(prefill_node/session.py is the other end; common/sessions/client.py the
machinery shared with the router's DecodeSession).

Two kinds of caller keep one per prefill node:

* a router sends each disaggregated request's Prefill on it
  (``prefill(command, timeout)``), beside the request to the decode node. It
  returns the Prefill's reply, or raises the ``grpc.aio.AioRpcError`` the
  Prefill failed with: DEADLINE_EXCEEDED past ``timeout``, the prefill node's
  own status, UNAVAILABLE when the session's call ends under it (the node
  died, restarted or stopped). Cancelling the task that awaits it sends a
  ``cancel`` command, and so does a timeout.
* a decode node sends the blocks it reserved for such a Prefill on it
  (``send_blocks``), with its KV channel: the prefill node sends none of the
  prompt's KV before they came.

The next use after a loss opens a new session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from common.sessions.client import (
    CODES,
    OK_CODE,
    VERSION_METADATA,
    SessionClient,
    status_error,
)
from proto import internal_pb2, internal_pb2_grpc


def start_command(
    req: internal_pb2.DecodeRequest, decode_node_id: str, decode_tp: int
) -> internal_pb2.PrefillSessionCommand:
    """The Prefill of ``req`` (its id, prompt, sampling and reservation) as a
    session's start command, its KV bound for ``decode_node_id``. Built in
    place: a constructor given the prompt's repeated field converts it id by
    id, and each enclosing constructor copies it again."""
    command = internal_pb2.PrefillSessionCommand()
    request = command.start.request
    request.request_id = req.request_id
    request.prompt_token_ids.extend(req.prompt_token_ids)
    request.sampling.CopyFrom(req.sampling)
    request.cache_salt = req.cache_salt
    request.resume_offset = req.resume_offset
    request.decode_node_id = decode_node_id
    request.decode_tensor_parallel_size = decode_tp
    request.reservation_id = req.reservation_id
    request.traceparent = req.traceparent
    if req.HasField("lora"):
        request.lora.CopyFrom(req.lora)
    return command


class PrefillSessionClient(SessionClient):
    """A router's or a decode node's session with one prefill node."""

    kind = "prefill node"

    def __init__(
        self,
        channel: grpc.aio.Channel,
        node_id: str,
        on_lost: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(node_id, on_lost)
        self._stub = internal_pb2_grpc.PrefillNodeStub(channel)
        self._replies: dict[str, asyncio.Future] = {}  # request_id -> its reply, until it came

    async def prefill(
        self, command: internal_pb2.PrefillSessionCommand, timeout: float
    ) -> internal_pb2.PrefillResponse:
        """The reply to ``command.start.request`` (built in the command: putting
        a finished PrefillRequest into one copies it, its prompt included).
        ``timeout`` covers everything, opening the session included, as a
        call's deadline covers connecting."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        rid = command.start.request.request_id
        reply: asyncio.Future | None = None
        try:
            if timeout <= 0:
                raise TimeoutError
            async with asyncio.timeout_at(deadline):
                await self._opened()
                reply = loop.create_future()
                # Retrieved even if its awaiter is gone (no warning at exit).
                reply.add_done_callback(lambda f: f.cancelled() or f.exception())
                self._replies[rid] = reply
                command.start.timeout_s = max(0.0, deadline - loop.time())
                await self._send(command)
                return await reply
        except TimeoutError:
            if reply is not None and reply.done() and not reply.cancelled():
                return reply.result()  # it came in the very turn the deadline passed
            raise status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            if reply is not None and self._replies.pop(rid, None) is not None:
                self._send_cancel(rid)  # given up on before its reply

    async def send_blocks(self, blocks: internal_pb2.PrefillBlocks, timeout: float) -> None:
        """A decode node's reserved blocks and KV channel for a Prefill; opens
        the session if need be (raises what a request would get where it cannot)."""
        command = internal_pb2.PrefillSessionCommand(blocks=blocks)
        async with asyncio.timeout(max(0.0, timeout)):
            await self._opened()
        await self._send(command)

    # ------------------------------------------------ SessionClient's hooks
    def _new_call(self):
        return self._stub.PrefillSession(metadata=VERSION_METADATA)

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
