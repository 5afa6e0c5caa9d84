"""The decode node's request path (asyncio): admit, reserve, have the prompt
filled, decode, stream. The KV landing (reservations, transfer callbacks, lease
expiry, commit) is ``decode_node/kv_landing.py``.

Life cycle of a request on a decode node:

1. ``Decode`` arrives from the router with the prompt's token ids and, usually,
   the prefill node to use. Without one (or for n > 1, or prompt logprobs) the
   request simply joins this node's engine, which prefills it itself.
2. Otherwise the engine reserves blocks for the whole prompt, starting from
   this node's own verified prefix-cache hit; no room means RESOURCE_EXHAUSTED
   before anything else happens.
3. The receiver is told to expect a transfer from that prefill node, and the
   node asks it to ``Prefill`` with the channel epoch, the reservation id and
   the first block it lacks: a message on its PrefillSession with that node
   (common/sessions/prefill.py), or a call of its own
   (``--prefill-streams call``).
4. The transfer arrives on the receiver's thread: the header names the
   reservation; if it is still waiting, the payload is scattered into its
   blocks (on the receiver's stream) and the reservation is LANDED; if it is
   gone (cancelled, failed), the payload is dropped and nothing is written.
5. With the KV and the first token in hand, the engine thread commits the
   request: it joins the running batch and the first token is processed like
   any other (text, stop conditions). The token comes with the Prefill reply
   (with the cache hit and the timings), or, where this node asked for it
   (``first_token_on_kv``: both nodes of one rank, no logprobs), on the KV
   channel right behind the prompt's last chunk, usually before the reply:
   the reply is then awaited only before the Final, which reports its
   timings. With ``--verify-kv`` the reply comes first and the channel's
   token is checked against it.
6. Each engine step yields at most one message per request, relayed as
   ``GenerateResponse`` deltas; the stream ends with the Final message.
Any failure or cancellation aborts the engine request (freeing reserved or
running blocks) and cancels the Prefill call (which frees the prefill side).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from common.grpc_server import CLIENT_OPTIONS
from common.kv_transfer import TransferError
from common.metrics.phases import PromptPhases
from common.runtime.reliability import (
    FaultDelays,
    FaultPoint,
    NoCapacity,
    Stage,
    check_queue,
    deadline_passed,
)
from common.sessions.prefill import PrefillSessionClient
from common.tls import NO_TLS, TLSConfig, make_channel
from common.wire import (
    StreamState,
    output_to_responses,
    sampling_params_from_proto,
    token_ids_of,
    token_logprobs_from_proto,
)
from decode_node.dispatched import dispatched_prefill
from decode_node.kv_landing import KVLanding
from decode_node.prefill_call import (
    PrefillFailed,
    PrefillStreams,
    first_token_of,
    lease_ended,
    prefill_command,
    prefill_timings,
)
from decode_node.stats import DecodeStats
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine, Reservation
from engine.request_stream import RequestStream, settled
from proto import internal_pb2, internal_pb2_grpc, pdserve_pb2

logger = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(
        self,
        node_id: str,
        engine: EngineThread,
        store_host: str,
        store_port: int,
        transfer_timeout_s: float = 30.0,
        verify_transfers: bool = False,
        kv_lease_s: float = 30.0,
        max_queued: int = 0,
        faults: FaultDelays | None = None,
        tls: TLSConfig = NO_TLS,
        prefill_streams: PrefillStreams = PrefillStreams.SESSION,
    ) -> None:
        if not kv_lease_s > 0:
            raise ValueError(f"the KV lease must be > 0 seconds, got {kv_lease_s}")
        self.node_id = node_id
        self.tls = tls  # for the Prefill calls
        self.engine = engine
        self.kv_lease_s = kv_lease_s
        self.max_queued = max_queued
        self.faults = faults or FaultDelays()
        # Takes requests whose Prefill the router sent (DecodeRequest.prefill_reservation_id):
        # their first token comes on the KV channel only, which needs one rank;
        # --verify-kv needs the reply's checksums, which go to the router then.
        self.takes_dispatched = engine.engine.model_runner.tp.size == 1 and not verify_transfers
        self.stats = DecodeStats()
        self._stages: dict[str, Stage] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.prefill_streams = prefill_streams
        self._sessions: dict[str, PrefillSessionClient] = {}  # by prefill node address
        self.landing = KVLanding(
            node_id,
            engine.engine.model_runner,
            store_host,
            store_port,
            self.stats,
            transfer_timeout_s=transfer_timeout_s,
            verify_transfers=verify_transfers,
            engine=engine,
        )

    # ----------------------------------------------------------- requests
    async def decode(
        self, req: internal_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        arrived = time.monotonic()
        rid = req.request_id
        params = sampling_params_from_proto(req.sampling)
        params.resume_offset = req.resume_offset  # a migrated stream's seeded draws
        prompt = {"prompt_token_ids": token_ids_of(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        stream = RequestStream()
        usage = pdserve_pb2.Usage(decode_node=self.node_id)
        remote = req.HasField("prefill") and params.n == 1 and params.prompt_logprobs is None
        self.stats.requests += 1
        self._stages[rid] = Stage.QUEUED
        reply: asyncio.Future | None = None  # the Prefill's, while it has not come
        try:
            if remote:
                usage.prefill_node = req.prefill.node_id
                reply, replied = await self._remote_prefill(
                    req,
                    lambda: self._reserve(rid, stream, prompt, params),
                    deadline,
                    usage,
                    arrived,
                    params.logprobs is None,
                )
                if reply is not None and reply.done():  # None: the router has it
                    prefill_timings(reply, usage)
                    reply = None
                self.stats.remote_prefills += 1
            else:
                await asyncio.wrap_future(
                    self.engine.add(
                        rid, stream.sink, lambda e: self._admit_local(e, rid, prompt, params)
                    )
                )
                self.stats.local_prefills += 1
            state = StreamState()
            timed = remote  # a remote prefill's phases came in its reply
            async for out in stream:
                self._stages[rid] = Stage.DECODE
                if (
                    remote
                    and not state.completion_tokens
                    and not usage.timing.decode_first_output_ms
                ):
                    usage.timing.decode_first_output_ms = (time.monotonic() - replied) * 1e3
                if not timed and (phases := PromptPhases.of(out.metrics)) is not None:
                    timed = True
                    self.stats.phases.observe(phases)
                    usage.timing.prefill_queue_ms = phases.queue_s * 1e3
                    usage.timing.prefill_compute_ms = phases.prefill_s * 1e3
                usage.cached_tokens = out.num_cached_tokens
                if out.finished and reply is not None:
                    # The Final reports the Prefill's timings: its reply first.
                    await asyncio.wait((reply,))
                    prefill_timings(reply, usage)
                    reply = None
                for resp in output_to_responses(out, rid, state, usage):
                    yield resp
        except NoCapacity:
            raise  # nothing was admitted
        except BaseException:
            stage = self._stages.get(rid, Stage.QUEUED)
            if deadline_passed(deadline):
                self.stats.aborts.deadline_exceeded += 1
            self.engine.call(lambda e: self._abort(e, rid, stage))
            raise
        finally:
            if reply is not None:
                reply.cancel()  # ended before the Final: nothing more is wanted of it
            self._stages.pop(rid, None)

    async def _reserve(self, rid: str, stream: RequestStream, prompt, params) -> Reservation:
        """The prompt's blocks, from this node's own prefix-cache hit on
        (NoCapacity when there is no room)."""
        # Inline: on this thread if the engine thread is idle (two hand-overs
        # between threads fewer).
        reservation = await settled(
            self.engine.add(
                rid, stream.sink, lambda e: e.reserve_request(rid, prompt, params), inline=True
            )
        )
        if reservation is None:
            self.engine.detach(rid)
            self.stats.rejected += 1
            raise NoCapacity(f"decode node {self.node_id} has no room for this request now")
        self._stages[rid] = Stage.PREFILL
        return reservation

    def _admit_local(self, engine: LLMEngine, rid: str, prompt, params) -> None:
        """On the engine thread: queue a request this node prefills itself, if the queue has room."""
        try:
            check_queue(*engine.queue_room(), self.max_queued, self.node_id)
        except NoCapacity:
            self.stats.rejected += 1
            raise
        engine.add_request(rid, prompt, params)

    async def _remote_prefill(
        self,
        req: internal_pb2.DecodeRequest,
        reserve: Callable[[], Awaitable[Reservation]],
        deadline: float | None,
        usage: pdserve_pb2.Usage,
        arrived: float,
        token_on_kv: bool,
    ) -> tuple[asyncio.Future, float]:
        """The reservation, the Prefill, the KV's landing and the commit; returns
        the reply (a future, not done yet where the first token came on the KV
        channel) and when the first token came (time.monotonic()).
        ``usage.timing`` gets the call's own times. Where the prefill node takes a
        Prefill whose blocks follow (its session said so; this node has one
        rank), the Prefill goes first and the reservation's blocks after it, so
        that the prompt computes while the blocks are reserved here; else the
        reservation goes first. ``token_on_kv``: the request wants no logprobs
        (the first token's logprobs come with the reply only)."""
        peer = req.prefill.node_id
        peer_tp = max(1, req.prefill.tensor_parallel_size)
        landing = self.landing
        if landing.verify_transfers and peer_tp > 1:
            raise PrefillFailed(
                peer,
                grpc.StatusCode.FAILED_PRECONDITION,
                "--verify-kv checks transfers between nodes of tensor-parallel size 1 only",
            )
        rid = req.request_id
        token_on_kv = token_on_kv and peer_tp == 1 and landing.tp_size == 1
        dispatched = req.prefill_reservation_id != 0  # the router sent the Prefill
        if dispatched and not (self.takes_dispatched and token_on_kv):
            raise ValueError(
                "a request whose Prefill the router sent needs a decode and a prefill node "
                "of one rank each, no --verify-kv here and no logprobs"
            )
        session = None
        if dispatched or self.prefill_streams is PrefillStreams.SESSION:
            session = self._session(req.prefill)
            await session.learn()  # what its node takes, before a destination names it
            landing.frames_blocks(peer, session.header_block)
        # Only while this node's engine thread is idle: the reservation then
        # runs inline right after the Prefill's write and its blocks follow
        # within a fraction of a millisecond. Behind a step in flight they
        # would keep the prefill node's engine waiting for it (late_blocks.py);
        # a busy node reserves first, as a tensor-parallel one does.
        follow = (
            session is not None
            and session.blocks_follow
            and landing.tp_size == 1
            and self.engine.idle
        )
        if not dispatched:
            command = prefill_command(req, landing, self.node_id, token_on_kv)
            request, destination = command.start.request, command.start.request.destination
        # The lease bounds how long the blocks stay reserved for this prefill
        # node, whatever the client's deadline: a stalled or dead node cannot
        # pin them, and the router can retry elsewhere (nothing was sent yet).
        lease_end = time.monotonic() + self.kv_lease_s
        end = lease_end if deadline is None else min(deadline, lease_end)
        reservation_id: int | None = None
        reply: asyncio.Future | None = None
        keep_reply = False  # handed back with the request committed
        try:
            try:
                if dispatched:
                    self.stats.dispatched_prefills += 1
                    reservation_id, replied, first_token, cached_tokens = await dispatched_prefill(
                        landing, req, reserve, session, self.node_id, end, deadline
                    )
                    sent, resp = arrived, None
                elif follow:
                    reservation_id, epoch = landing.expect(peer, peer_tp)
                    landing.name_channel(destination, peer, epoch)
                    destination.reservation_id = reservation_id
                    request.blocks_follow = True
                    sent = time.monotonic()
                    written = asyncio.get_running_loop().create_future()
                    reply = asyncio.ensure_future(
                        session.prefill(command, max(0.0, end - sent), written)
                    )
                    # Reserve once the Prefill is on its way (an inline
                    # reservation holds this loop): the prompt computes meanwhile.
                    await asyncio.wait((written, reply), return_when=asyncio.FIRST_COMPLETED)
                    if not reply.done():  # else it failed: its error is raised below
                        self.stats.early_prefills += 1
                        reservation = await reserve()
                        try:
                            landing.open(
                                rid, reservation, peer, peer_tp, reservation_id, token_on_kv
                            )
                        except TransferError as e:  # its channel failed meanwhile
                            raise PrefillFailed(peer, grpc.StatusCode.UNAVAILABLE, str(e)) from e
                        session.send_blocks(
                            rid, reservation.first_block, len(reservation.block_ids)
                        )
                else:
                    reservation = await reserve()
                    reservation_id, epoch = landing.open(
                        rid, reservation, peer, peer_tp, first_token=token_on_kv
                    )
                    landing.name_channel(destination, peer, epoch)
                    destination.reservation_id = reservation_id
                    destination.first_block = reservation.first_block
                    destination.num_blocks = len(reservation.block_ids)
                    sent = time.monotonic()
                usage.timing.decode_admit_ms = (sent - arrived) * 1e3
                if dispatched:
                    pass  # the router has the reply
                elif reply is None:
                    reply = asyncio.ensure_future(
                        self._prefill(req.prefill, command, max(0.0, end - sent))
                    )
                if not dispatched:
                    first_token, cached_tokens, resp = await first_token_of(
                        landing, self.stats, reservation_id, reply
                    )
                    replied = time.monotonic()
                usage.timing.prefill_call_ms = (replied - sent) * 1e3
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED and end == deadline:
                    raise  # the client's own deadline: no retry
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    landing.reset_peer(peer)
                if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    landing.expire(reservation_id)
                    raise PrefillFailed(
                        peer, e.code(), f"no KV within the {self.kv_lease_s:g} s lease"
                    ) from e
                raise PrefillFailed(peer, e.code(), e.details() or e.code().name) from e
            self._stages[req.request_id] = Stage.TRANSFER
            try:
                await landing.wait(reservation_id, max(0.0, end - time.monotonic()))
            except TimeoutError:
                failed = lease_ended(landing, peer, reservation_id, deadline, "the KV did not land")
                if failed is None:
                    raise
                raise failed from None
            except TransferError as e:
                raise PrefillFailed(peer, grpc.StatusCode.UNAVAILABLE, str(e)) from e
            if resp is not None and landing.verify_transfers:  # a mismatch fails the request
                landing.check(reservation_id, resp.kv_checksum)
                left = max(0.0, end - time.monotonic())
                await landing.check_token(reservation_id, first_token, cached_tokens, left)
            self._stages[req.request_id] = Stage.ADMISSION
            if delay := self.faults.get(FaultPoint.DECODE_BEFORE_COMMIT):
                await asyncio.sleep(delay)
            first_logprobs = (
                token_logprobs_from_proto(resp.first_logprobs)
                if resp is not None and resp.HasField("first_logprobs")
                else None
            )
            # Inline when it can be, the first token then already in the
            # stream: it goes out in this turn of the loop.
            await settled(
                self.engine.call(
                    lambda e: landing.commit(
                        e, reservation_id, first_token, first_logprobs, cached_tokens
                    ),
                    inline=True,
                )
            )
            keep_reply = True
            return reply, replied
        finally:
            if reply is not None and not reply.done() and not keep_reply:
                reply.cancel()  # the session cancels the Prefill on the node
            if reservation_id is not None:
                landing.close(reservation_id)

    def _prefill(
        self,
        node: internal_pb2.NodeRef,
        command: internal_pb2.PrefillSessionCommand,
        timeout: float,
    ):
        """The Prefill of ``command.start.request``: on the node's session, or a call of its own."""
        if self.prefill_streams is PrefillStreams.CALL:
            stub = internal_pb2_grpc.PrefillNodeStub(self._channel(node.address))
            return stub.Prefill(command.start.request, timeout=timeout)
        return self._session(node).prefill(command, timeout)

    def _session(self, node: internal_pb2.NodeRef) -> PrefillSessionClient:
        """The PrefillSession with ``node`` (opened by its first Prefill)."""
        session = self._sessions.get(node.address)
        if session is None:
            # A session that ends tells what a Prefill breaking would: the node
            # died, restarted or stalled. Its KV channels move to a new epoch
            # then, even with no Prefill in flight to break: the first transfer
            # from a restarted node must not rendezvous on the dead one's.
            peer = node.node_id
            session = self._sessions[node.address] = PrefillSessionClient(
                self._channel(node.address), peer, on_lost=lambda: self.landing.reset_peer(peer)
            )
        return session

    # ------------------------------------------------------ engine thread
    def _abort(self, engine: LLMEngine, rid: str, stage: Stage) -> None:
        req = engine.requests.get(rid)
        if stage is Stage.QUEUED and req is not None and req.first_scheduled_time is not None:
            stage = Stage.PREFILL  # a local prefill under way (only the engine knows)
        self.stats.aborts.aborted(stage)
        self.landing.wait_for_landings(rid)
        engine.abort_request(rid)

    # ---------------------------------------------------------------- misc
    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address, self.tls, CLIENT_OPTIONS)
        return channel

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self.landing.close_receiver()
        for channel in self._channels.values():
            await channel.close()
