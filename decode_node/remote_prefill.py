"""A disaggregated request on the decode node: its prompt's KV from a prefill node.

The router sends the request's Prefill to the prefill node and the request
here at the same time, both under the reservation id it chose
(``DecodeRequest.reservation_id``); the prompt computes on the prefill node
while this node admits the request. Life cycle here (``PrefillState``):

1. RESERVING: the engine reserves the prompt's blocks, starting from this
   node's own verified prefix-cache hit (inline when the engine thread is
   idle, else between two steps). No room: RESOURCE_EXHAUSTED, nothing else
   happened (the router retries elsewhere and cancels the Prefill).
2. BLOCKS_SENT: the reservation is open on the KV landing under the router's
   id (the receiver expects the prefill node's stream for it), and the blocks,
   with this node's KV channel (store, epoch, size), went to the prefill node
   as a ``blocks`` command on this node's PrefillSession with it. The prefill
   node sends none of the KV before they came.
3. LANDED: every KV chunk landed, and the first token (with its logprobs, where
   asked) came on the channel right behind them.
4. COMMITTED: the request joined the running batch with that token, which
   goes out at once (decode_node/worker.py streams the rest).

Or FAILED: the lease (``--kv-lease``) or the client's deadline passed, the
channel failed, the prefill node's session ended (it died, restarted or
stalled), or the KV did not fit. ``PrefillFailed`` names the prefill node: the
router retries on another one (nothing reached the client yet). The router
also cancels the request here when the Prefill fails on the prefill node.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable

import grpc

from common.kv_transfer import TransferError
from common.kv_transfer.protocol import FirstToken
from common.runtime.reliability import FaultDelays, FaultPoint
from common.sessions.prefill import PrefillSessionClient
from decode_node.kv_landing import KVLanding
from engine.engine_thread import EngineThread
from engine.llm_engine import Reservation
from engine.request_stream import settled
from engine.sequence import TokenLogprobs
from proto import internal_pb2, pdserve_pb2


class PrefillState(enum.Enum):
    """Where a disaggregated request stands on its decode node (module docstring)."""

    RESERVING = "reserving"
    BLOCKS_SENT = "blocks_sent"
    LANDED = "landed"
    COMMITTED = "committed"
    FAILED = "failed"


class PrefillFailed(RuntimeError):
    """The named prefill node did not deliver the prompt's KV (unreachable,
    stalled past the lease, channel failure). Nothing was sent to the client
    yet, so the router may safely retry on another prefill node."""

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


class RemotePrefill:
    """One request's way through the states above (the request path's loop only)."""

    def __init__(
        self,
        req: internal_pb2.DecodeRequest,
        landing: KVLanding,
        session: PrefillSessionClient,
        node_id: str,
        end: float,
        deadline: float | None,
    ) -> None:
        self.req = req
        self.peer = req.prefill.node_id
        self.peer_tp = max(1, req.prefill.tensor_parallel_size)
        self.landing = landing
        self.session = session
        self.node_id = node_id
        # The lease's end or the client's deadline, whichever comes first
        # (time.monotonic()): a stalled prefill node cannot pin the blocks.
        self.end = end
        self.deadline = deadline
        self.state = PrefillState.RESERVING
        self.blocks_sent_at = 0.0  # time.monotonic(), for the request's timings

    async def run(
        self,
        reserve: Callable[[], Awaitable[Reservation]],
        engine: EngineThread,
        faults: FaultDelays,
    ) -> None:
        """Reserve, send the blocks, await the KV and the first token, commit."""
        reservation = await reserve()
        rid = self.req.reservation_id
        try:
            epoch = self.landing.open(
                self.req.request_id, reservation, self.peer, self.peer_tp, rid
            )
        except ValueError as e:  # an id in use here (two routers' ids met): retry elsewhere
            raise PrefillFailed(self.peer, grpc.StatusCode.UNAVAILABLE, str(e)) from e
        try:
            await self._send_blocks(reservation, epoch)
            self.state = PrefillState.BLOCKS_SENT
            token = await self._landed()
            self.state = PrefillState.LANDED
            if delay := faults.get(FaultPoint.DECODE_BEFORE_COMMIT):
                await asyncio.sleep(delay)
            # Inline when it can be: the first token then goes out in this turn of the loop.
            await settled(
                engine.call(
                    lambda e: self.landing.commit(
                        e, rid, token.token_id, _logprobs(token), token.cached_tokens
                    ),
                    inline=True,
                )
            )
            self.state = PrefillState.COMMITTED
        except Exception:
            # A cancel (the client's, or the request's deadline) is not a
            # failure: the state stays where it was, the stage its abort counts.
            self.state = PrefillState.FAILED
            raise
        finally:
            self.landing.close(rid)  # committed, or nothing lands in it now

    async def _send_blocks(self, reservation: Reservation, epoch: int) -> None:
        blocks = internal_pb2.PrefillBlocks(
            request_id=self.req.request_id,
            reservation_id=self.req.reservation_id,
            first_block=reservation.first_block,
            num_blocks=len(reservation.block_ids),
        )
        channel = blocks.channel
        channel.node_id = self.node_id
        channel.store_host = self.landing.receiver.host
        channel.store_port = self.landing.receiver.port
        channel.epoch = epoch
        channel.tensor_parallel_size = self.landing.tp_size
        channel.kv_cache_dtype = self.landing.kv_cache_dtype
        try:
            await self.session.send_blocks(blocks, self.end - time.monotonic())
        except TimeoutError:
            self._lease_ended("no session with the prefill node")
        except grpc.aio.AioRpcError as e:
            raise PrefillFailed(self.peer, e.code(), e.details() or e.code().name) from e
        self.blocks_sent_at = time.monotonic()

    async def _landed(self) -> FirstToken:
        """The first token, once the KV and it landed (and, with --verify-kv, the
        prefill node's checksum matched)."""
        rid = self.req.reservation_id
        landing = self.landing
        try:
            async with asyncio.timeout_at(_loop_time(self.end)):
                token = await landing.first_token(rid)
                if token is None:  # none will come: the KV's own failure (if any) says why
                    with contextlib.suppress(TimeoutError):
                        await landing.wait(rid, 0)
                    raise TransferError("no first token came on the KV channel")
                await landing.wait(rid, max(0.0, self.end - time.monotonic()))
                await landing.check(rid, max(0.0, self.end - time.monotonic()))
        except TimeoutError:
            self._lease_ended("the KV did not land")
        except TransferError as e:
            raise PrefillFailed(self.peer, grpc.StatusCode.UNAVAILABLE, str(e)) from e
        return token

    def _lease_ended(self, what: str) -> None:
        """A wait for the prefill node timed out: the client's own deadline (its
        TimeoutError stands: no retry), or the lease (the prefill node is at fault)."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeoutError(what)
        self.landing.expire(self.req.reservation_id)
        raise PrefillFailed(
            self.peer, grpc.StatusCode.DEADLINE_EXCEEDED, f"{what} within the KV lease"
        )

    def timings(self, usage: pdserve_pb2.Usage, arrived: float, landed: float) -> None:
        """This node's part of the request's timings (``usage.timing``)."""
        usage.timing.decode_admit_ms = (self.blocks_sent_at - arrived) * 1e3
        usage.timing.kv_wait_ms = (landed - self.blocks_sent_at) * 1e3


def _logprobs(token: FirstToken) -> TokenLogprobs | None:
    if token.logprobs is None:
        return None
    logprob, rank, top_ids, top_logprobs = token.logprobs
    return TokenLogprobs(logprob, rank, top_ids, top_logprobs)


def _loop_time(monotonic: float) -> float:
    """A time.monotonic() deadline on the running loop's clock (uvloop's is another)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic - time.monotonic())
