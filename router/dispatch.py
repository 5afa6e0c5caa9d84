"""The router's side of a disaggregated request: its Prefill.

The router sends a disaggregated request's Prefill to the prefill node itself,
on a PrefillSession of its own with that node, just before the request to the
decode node, so that the prompt computes while the decode node admits the
request and reserves its blocks: neither waits for the other. Both carry the
reservation id the router chose (``DecodeRequest.reservation_id``); the
decode node sends its reserved blocks and its KV channel to the prefill node
(decode_node/remote_prefill.py), and the prompt's KV and first token go to
the decode node on that channel. The Prefill's reply (its own figures) comes
back here; nothing waits for it.

Failures: a Prefill that fails before the decode node's first message ends
the request on the decode node (a cancel), the prefill node named as the
failed node, UNAVAILABLE (or RESOURCE_EXHAUSTED: it is full), so that the
router retries elsewhere. The request failing on the decode node cancels the
Prefill.
"""

from __future__ import annotations

import asyncio
import secrets

import grpc

from common.runtime.reliability import FAILED_NODE_KEY
from common.sessions.client import status_error
from common.sessions.prefill import PrefillSessionClient, start_command
from proto import internal_pb2

# How long a Prefill may take when the client set no deadline: a decode node's
# default KV lease (its own request fails past its lease anyway).
PREFILL_TIMEOUT_S = 30.0
# Reservation ids are int64 words in the KV headers; each router counts up from
# a random point, so that several routers' ids practically never meet on one
# decode node (which refuses an id in use, and the router retries).
_ID_SPAN = 1 << 62


class PrefillDispatcher:
    """The router's PrefillSessions (one per prefill node) and its reservation ids."""

    def __init__(self, channel_of) -> None:
        self._channel_of = channel_of  # address -> grpc.aio.Channel (the router's)
        self._sessions: dict[str, PrefillSessionClient] = {}  # by prefill node address
        self._next_id = 1 + secrets.randbelow(_ID_SPAN)

    def session(self, node) -> PrefillSessionClient:
        session = self._sessions.get(node.address)
        if session is None:
            session = self._sessions[node.address] = PrefillSessionClient(
                self._channel_of(node.address), node.node_id
            )
        return session

    def forget(self, address: str) -> None:
        """The node at ``address`` restarted: its next Prefill opens a new session."""
        self._sessions.pop(address, None)

    def reservation_id(self) -> int:
        """A fresh id (never reused by this router)."""
        rid = self._next_id
        self._next_id = rid + 1 if rid + 1 < 1 << 63 else 1
        return rid

    def send(
        self,
        prefill,
        request: internal_pb2.DecodeRequest,
        decode,
        timeout: float | None,
    ) -> asyncio.Future:
        """Send ``request``'s Prefill to ``prefill`` (its reservation id set in
        ``request``), its KV bound for ``decode``; the future is its reply, or
        fails with the Prefill's status."""
        request.reservation_id = self.reservation_id()
        command = start_command(request, decode.node_id, decode.tensor_parallel_size)
        session = self.session(prefill)
        reply = asyncio.ensure_future(
            session.prefill(command, PREFILL_TIMEOUT_S if timeout is None else timeout)
        )
        # Retrieved even when nobody awaits it any more (no warning at exit).
        reply.add_done_callback(lambda f: f.cancelled() or f.exception())
        return reply

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()


# A Prefill's statuses the router keeps; any other is the prefill node's
# failure (UNAVAILABLE): the router retries elsewhere.
KEPT_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION)


def failed_by_prefill(error: BaseException, prefill_id: str) -> grpc.aio.AioRpcError:
    """The Prefill's failure as the request's: the prefill node named as the
    one at fault, RESOURCE_EXHAUSTED (it is full), FAILED_PRECONDITION (it
    speaks another protocol version) or UNAVAILABLE (anything else)."""
    if isinstance(error, grpc.aio.AioRpcError):
        code, details = error.code(), error.details() or error.code().name
    else:
        code, details = grpc.StatusCode.UNAVAILABLE, f"{type(error).__name__}: {error}"
    if code not in KEPT_CODES:
        code = grpc.StatusCode.UNAVAILABLE
    if not details.startswith(f"prefill node {prefill_id}"):  # the session's own say so
        details = f"prefill node {prefill_id}: {details}"
    return status_error(code, details, ((FAILED_NODE_KEY, prefill_id),))
