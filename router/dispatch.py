"""The Prefill from the router (``--prefill-dispatch router``).

A disaggregated request's Prefill went from the decode node to the prefill
node, after the request reached the decode node and the decode node admitted
it: the decode node's admission and the Prefill's leg from there (about 1 ms
on the GPU host, docs/performance.md) were on every first token before the
prefill node heard of the request. With this mode the router sends the Prefill
itself, on a PrefillSession of its own with the prefill node, just before the
request to the decode node, so that the two legs run side by side; the decode
node reserves the blocks meanwhile and sends them to the prefill node
(decode_node/dispatched.py), and the prompt's KV and first token go to the
decode node on the KV channel the two already have.

When: a prefill node and a decode node of one rank each whose sessions said
they take such Prefills (an older release or --verify-kv says not), a request
with n = 1 and no logprobs, and a pair of nodes that already served a request
the decode node's way (whose Prefill named the channel the router's Prefill
then uses). Otherwise, and while the sessions are opening, the decode node
sends the Prefill as before.

Failures: a Prefill that fails before the decode node sent anything for the
request ends the request on the decode node (a cancel), the prefill node named
as the failed node, UNAVAILABLE (or RESOURCE_EXHAUSTED: it is full), as the
decode node reports its own Prefill's failure, so that the router retries
elsewhere;
a prefill node whose channel to that decode node is not the decode node's any
more (FAILED_PRECONDITION: one of them restarted, or the channel failed) is not
avoided, and the pair goes the decode node's way until it served a request so.
The request failing on the decode node (no room) cancels the Prefill.
"""

from __future__ import annotations

import asyncio
import enum
import secrets

import grpc

from common.runtime.reliability import FAILED_NODE_KEY
from common.sessions.client import status_error
from common.sessions.prefill import PrefillSessionClient, start_command
from common.wire import FIRST_ROUTER_RESERVATION_ID
from proto import internal_pb2

# How long a router's Prefill may take when the client set no deadline: a
# decode node's default KV lease (its own request fails past its lease anyway).
PREFILL_TIMEOUT_S = 30.0


class PrefillDispatch(enum.Enum):
    """Who sends a disaggregated request's Prefill (--prefill-dispatch)."""

    DECODE = "decode"  # the decode node, once it admitted the request
    ROUTER = "router"  # the router, beside the request to the decode node

    def __str__(self) -> str:  # argparse shows choices by str()
        return self.value


class PrefillDispatcher:
    """The router's PrefillSessions and the node pairs it sends Prefills for."""

    def __init__(self, channel_of) -> None:
        self._channel_of = channel_of  # address -> grpc.aio.Channel (the router's)
        self._sessions: dict[str, PrefillSessionClient] = {}  # by prefill node address
        self._warming: set[str] = set()
        # (prefill node, decode node) pairs that served a request the decode
        # node's way since the router last heard their channel was not theirs.
        self._pairs: set[tuple[str, str]] = set()
        # This router's reservation ids: a random start in the routers' range
        # (several routers) and a count (never reused by this one).
        span = 1 << 61
        self._next_id = FIRST_ROUTER_RESERVATION_ID + secrets.randbelow(span)

    def session(self, node) -> PrefillSessionClient:
        session = self._sessions.get(node.address)
        if session is None:
            node_id = node.node_id
            # A lost session (the node died, restarted or stalled) takes the
            # channels it named with it: its pairs go the decode node's way again.
            session = self._sessions[node.address] = PrefillSessionClient(
                self._channel_of(node.address), node_id, on_lost=lambda: self.forget(node_id)
            )
        return session

    def usable(self, prefill, decode, decode_takes: bool) -> PrefillSessionClient | None:
        """The session to send this pair's Prefill on, or None (the decode node
        sends it). ``decode_takes``: the decode node may take it now. Opens the
        prefill node's session in the background where none is open (whatever
        the decode node says), so that a later request finds it open."""
        if prefill.tensor_parallel_size > 1:
            return None
        session = self.session(prefill)
        if not session.dispatched:
            # None open (the first use, or the node restarted since): open one
            # for the next request. A node that serves none, or one that said it
            # takes no such Prefill, is left alone.
            fresh = not session.is_open and session.supported is not False
            if fresh and prefill.address not in self._warming:
                self._warming.add(prefill.address)
                task = asyncio.ensure_future(self._warm(session, prefill.address))
                task.add_done_callback(lambda f: f.cancelled() or f.exception())
            return None
        if not decode_takes:
            return None
        if (prefill.node_id, decode.node_id) not in self._pairs:
            return None
        return session

    async def _warm(self, session: PrefillSessionClient, address: str) -> None:
        try:
            await session.open()
        finally:
            self._warming.discard(address)

    def send(
        self,
        session: PrefillSessionClient,
        request: internal_pb2.DecodeRequest,
        decode_node_id: str,
        timeout: float | None,
    ) -> asyncio.Future:
        """Send ``request``'s Prefill (its reservation id set in ``request``);
        the future is its reply, or fails with the Prefill's status."""
        reservation_id = self._next_id
        self._next_id += 1
        command = start_command(request)
        prefill = command.start.request
        prefill.blocks_follow = prefill.first_token_on_kv = prefill.dispatched = True
        prefill.destination.node_id = decode_node_id
        prefill.destination.reservation_id = reservation_id
        request.prefill_reservation_id = reservation_id
        reply = asyncio.ensure_future(
            session.prefill(command, PREFILL_TIMEOUT_S if timeout is None else timeout)
        )
        # Retrieved even when nobody awaits it any more (no warning at exit).
        reply.add_done_callback(lambda f: f.cancelled() or f.exception())
        return reply

    def served(self, prefill_id: str, decode_id: str) -> None:
        """A request through this pair succeeded: its channel is theirs."""
        self._pairs.add((prefill_id, decode_id))

    def stale(self, prefill_id: str, decode_id: str) -> None:
        """The prefill node's channel to the decode node is not the decode node's."""
        self._pairs.discard((prefill_id, decode_id))

    def forget(self, prefill_id: str) -> None:
        """The prefill node's session was lost: none of its pairs is known now."""
        self._pairs = {pair for pair in self._pairs if pair[0] != prefill_id}

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()


def eligible(params) -> bool:
    """A request whose Prefill the router may send: one sequence, no logprobs
    (the first token then comes on the KV channel, with no reply in between)."""
    return params.n == 1 and params.logprobs is None and params.prompt_logprobs is None


# A Prefill's statuses the router tells apart; any other is the prefill node's
# failure (UNAVAILABLE), as a decode node reports its own Prefill's (PrefillFailed).
KEPT_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION)


def failed_by_prefill(error: BaseException, prefill_id: str) -> grpc.aio.AioRpcError:
    """The Prefill's failure as the decode node's call would have ended: the
    prefill node named as the one at fault, RESOURCE_EXHAUSTED (it is full),
    FAILED_PRECONDITION (its channel to the decode node is not the decode
    node's) or UNAVAILABLE (anything else: the router retries elsewhere)."""
    if isinstance(error, grpc.aio.AioRpcError):
        code, details = error.code(), error.details() or error.code().name
    else:
        code, details = grpc.StatusCode.UNAVAILABLE, f"{type(error).__name__}: {error}"
    if code not in KEPT_CODES:
        code = grpc.StatusCode.UNAVAILABLE
    if not details.startswith(f"prefill node {prefill_id}"):  # the session's own say so
        details = f"prefill node {prefill_id}: {details}"
    return status_error(code, details, ((FAILED_NODE_KEY, prefill_id),))
