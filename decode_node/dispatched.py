"""A request whose Prefill the router sent itself (DecodeRequest.prefill_reservation_id).

The router sends the Prefill to the prefill node at the same time as the
request here, under a reservation id of its own (from
FIRST_ROUTER_RESERVATION_ID up), and the prefill node computes at once, on the
KV channel it already has with this node. Here: reserve the prompt's blocks,
expect that reservation on the channel, send the blocks on this node's own
PrefillSession with the prefill node, with this node's channel (the prefill
node fails the Prefill where its channel is not that one, and ends the
reservation's stream on it whatever became of the Prefill), and await
the first token, which comes on the KV channel behind the prompt's last chunk.
The Prefill's reply goes to the router, which fails the request here (cancels
it) where the Prefill failed.

Why: the decode node's admission and the Prefill's leg from here to the
prefill node (about 1 ms on the GPU host) were on every disaggregated first
token, before the prefill node heard of the request (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import grpc

from common.kv_transfer import TransferError
from common.sessions.prefill import PrefillSessionClient
from decode_node.kv_landing import KVLanding
from decode_node.prefill_call import PrefillFailed, lease_ended
from engine.llm_engine import Reservation
from proto import internal_pb2


async def dispatched_prefill(
    landing: KVLanding,
    req: internal_pb2.DecodeRequest,
    reserve: Callable[[], Awaitable[Reservation]],
    session: PrefillSessionClient,
    node_id: str,
    end: float,
    deadline: float | None,
) -> tuple[int, float, int, int]:
    """Returns (reservation id, when the first token came, the token, cached
    prompt tokens); the reservation is open (the caller closes it). ``end``:
    the lease's end or the client's deadline, whichever comes first."""
    peer = req.prefill.node_id
    # Reserved first: a node with no room expects nothing (the prefill node sends
    # nothing for this reservation before the blocks, which follow the expectation).
    reservation = await reserve()
    reservation_id, epoch = landing.expect(peer, 1, req.prefill_reservation_id)
    try:
        try:
            landing.open(req.request_id, reservation, peer, 1, reservation_id, True)
        except TransferError as e:  # its channel failed meanwhile
            raise PrefillFailed(peer, grpc.StatusCode.UNAVAILABLE, str(e)) from e
        first = landing.first_token(reservation_id)
        destination = internal_pb2.KVDestination(
            node_id=node_id,
            store_host=landing.receiver.host,
            store_port=landing.receiver.port,
            reservation_id=reservation_id,
            tensor_parallel_size=1,
        )
        landing.name_channel(destination, peer, epoch)
        await session.send_dispatched_blocks(
            req.request_id, reservation, destination, end - time.monotonic()
        )
        try:
            async with asyncio.timeout_at(end):
                came = await first
            if came is None:  # none will come: the KV's own failure (if any) says why
                with contextlib.suppress(TimeoutError):
                    await landing.wait(reservation_id, 0)
                raise TransferError("no first token on the KV channel")
        except TimeoutError:
            if (failed := lease_ended(landing, peer, reservation_id, deadline, "no KV")) is None:
                raise
            raise failed from None
        except TransferError as e:
            raise PrefillFailed(peer, grpc.StatusCode.UNAVAILABLE, str(e)) from e
    except BaseException:
        landing.close(reservation_id)  # expected, or opened: nothing lands in it now
        raise
    return reservation_id, time.monotonic(), *came
