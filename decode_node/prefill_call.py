"""What a decode node sends a prefill node, and what it makes of the answer
(the request path is decode_node/worker.py)."""

from __future__ import annotations

import asyncio
import enum
import logging
import time

import grpc

from common.sessions.prefill import start_command
from common.wire import prefill_reply_timings
from proto import internal_pb2, pdserve_pb2

logger = logging.getLogger(__name__)


class PrefillStreams(enum.Enum):
    """How a decode node sends its Prefills (--prefill-streams)."""

    SESSION = "session"  # every Prefill to a prefill node over one PrefillSession call
    CALL = "call"  # one Prefill call per request

    def __str__(self) -> str:  # argparse shows choices by str()
        return self.value


class PrefillFailed(RuntimeError):
    """The named prefill node did not deliver the prompt's KV (unreachable,
    stalled past the lease, overloaded, channel failure). Nothing was sent to
    the client yet, so the router may safely retry on another prefill node."""

    def __init__(self, node_id: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"prefill node {node_id} failed: {message}")
        self.node_id = node_id
        self.code = code

    @property
    def status_code(self) -> grpc.StatusCode:
        """What the router is told: RESOURCE_EXHAUSTED (the prefill node is full)
        or UNAVAILABLE, both of which it retries on another prefill node."""
        if self.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return self.code
        return grpc.StatusCode.UNAVAILABLE


def prefill_command(
    req: internal_pb2.DecodeRequest, landing, node_id: str, token_on_kv: bool
) -> internal_pb2.PrefillSessionCommand:
    """The Prefill of ``req`` as a session's start command (a Prefill call sends
    its request), its destination this node's receiver with no blocks yet."""
    command = start_command(req)
    request = command.start.request
    request.first_token_on_kv = token_on_kv
    destination = request.destination
    destination.node_id = node_id
    destination.store_host = landing.receiver.host
    destination.store_port = landing.receiver.port
    destination.tensor_parallel_size = landing.tp_size
    return command


def prefill_timings(reply: asyncio.Future, usage: pdserve_pb2.Usage) -> None:
    """The Prefill's own times into ``usage``, from its reply. A reply that
    failed after the first token came on the KV channel (the prefill node died
    after sending it) leaves them unset: the KV and the token had all come."""
    if reply.cancelled() or reply.exception() is not None:
        if not reply.cancelled():
            logger.warning("a Prefill's reply failed after its first token: %s", reply.exception())
        return
    prefill_reply_timings(reply.result(), usage)


def lease_ended(
    landing, peer: str, reservation_id: int, deadline: float | None, what: str
) -> PrefillFailed | None:
    """What a wait for the prefill node that timed out fails with: None where the
    client's own deadline passed (its TimeoutError stands: no retry); else the
    reservation expires and the prefill node is at fault ("``what`` within the lease")."""
    if deadline is not None and time.monotonic() >= deadline:
        return None
    landing.expire(reservation_id)
    return PrefillFailed(peer, grpc.StatusCode.DEADLINE_EXCEEDED, f"{what} within the lease")


async def first_token_of(landing, stats, reservation_id: int, reply: asyncio.Future):
    """(first token, cached prompt tokens, the reply or None where the token came
    on the KV channel first: the Final waits for the reply then)."""
    first = landing.first_token(reservation_id)
    # With --verify-kv the reply (its checksum) is awaited, and the token on
    # the channel checked against the reply's.
    fast = first is not None and not landing.verify_transfers
    if fast:
        # Retrieved even when the Final no longer awaits it (no warning).
        reply.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.wait((reply, first), return_when=asyncio.FIRST_COMPLETED)
    if fast and first.done() and first.result() is not None:
        stats.decoded_before_reply += 1
        return *first.result(), None
    resp = await reply
    return resp.first_token_id, resp.cached_tokens, resp
