"""The decode node's engine: admit, reserve, have the prompt filled, decode, stream.

Life cycle of a request on a decode node:

1. ``Decode`` arrives from the router with the prompt's token ids and, usually,
   the prefill node to use. Without one (or for n > 1, or prompt logprobs) the
   request simply joins this node's engine, which prefills it itself.
2. Otherwise the engine reserves blocks for the whole prompt, starting from
   this node's own verified prefix-cache hit; no room means RESOURCE_EXHAUSTED
   before anything else happens.
3. The receiver is told to expect a transfer from that prefill node, and the
   node calls ``Prefill`` with the channel epoch, the reservation id and the
   first block it lacks.
4. The transfer arrives on the receiver's thread: the header names the
   reservation; if it is still waiting, the payload is scattered into its
   blocks (on the receiver's stream) and the reservation is LANDED; if it is
   gone (cancelled, failed), the payload is dropped and nothing is written.
5. With both the KV and the Prefill reply (first token, cache hit, timings) in
   hand, the engine thread commits the request: it joins the running batch and
   the first token is processed like any other (text, stop conditions).
6. Each engine step yields at most one message per request, relayed as
   ``GenerateResponse`` deltas; the stream ends with the Final message.
Any failure or cancellation aborts the engine request (freeing reserved or
running blocks) and cancels the Prefill call (which frees the prefill side).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from common.engine.engine_thread import EngineThread, RequestStream
from common.engine.llm_engine import LLMEngine, Reservation
from common.grpc_server import CLIENT_OPTIONS
from common.kv_transfer import KVReceiver, TransferError, TransferHeader, TransferState
from common.kv_transfer.loopback import checksum
from common.reliability import (
    AbortCounters,
    FaultDelays,
    FaultPoint,
    NoCapacity,
    Stage,
    check_queue,
    deadline_passed,
)
from common.tls import NO_TLS, TLSConfig, make_channel
from common.wire import (
    StreamState,
    output_to_responses,
    sampling_params_from_proto,
    token_logprobs_from_proto,
)
from proto import internal_pb2, internal_pb2_grpc, pdserve_pb2

logger = logging.getLogger(__name__)


class PrefillFailed(RuntimeError):
    """The named prefill node did not deliver the prompt's KV (unreachable,
    stalled past the lease, overloaded, channel failure). Nothing was sent to
    the client yet, so the router may safely retry on another prefill node."""

    def __init__(self, node_id: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"prefill node {node_id} failed: {message}")
        self.node_id = node_id
        self.code = code


@dataclass(slots=True)
class PendingKV:
    """A reservation waiting for its prompt's KV (shared with the receiver thread)."""

    request_id: str
    reservation: Reservation
    peer: str
    landed: asyncio.Future
    loop: asyncio.AbstractEventLoop
    state: TransferState = TransferState.RESERVED
    landed_event: torch.cuda.Event | None = None
    digest: bytes | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def resolve(self, error: BaseException | None = None) -> None:
        def done() -> None:
            if not self.landed.done():
                if error is None:
                    self.landed.set_result(None)
                else:
                    self.landed.set_exception(error)

        self.loop.call_soon_threadsafe(done)


@dataclass(slots=True)
class DecodeStats:
    requests: int = 0
    remote_prefills: int = 0
    local_prefills: int = 0
    transfers_landed: int = 0
    late_transfers: int = 0
    transfer_failures: int = 0
    checksum_mismatches: int = 0
    bytes_received: int = 0
    leases_expired: int = 0
    rejected: int = 0  # refused for lack of room (RESOURCE_EXHAUSTED)
    aborts: AbortCounters = field(default_factory=AbortCounters)

    def counters(self) -> dict[str, int]:
        return {
            **self.aborts.counters(),
            "leases_expired": self.leases_expired,
            "rejected": self.rejected,
            "requests_total": self.requests,
            "kv_transfers": self.transfers_landed,
            "kv_transfer_failures": self.transfer_failures,
            "kv_late_transfers": self.late_transfers,
            "kv_checksum_mismatches": self.checksum_mismatches,
            "kv_transfer_bytes": self.bytes_received,
        }


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
    ) -> None:
        if not kv_lease_s > 0:
            raise ValueError(f"the KV lease must be > 0 seconds, got {kv_lease_s}")
        self.node_id = node_id
        self.tls = tls  # for the Prefill calls
        self.engine = engine
        self.verify_transfers = verify_transfers
        self.kv_lease_s = kv_lease_s
        self.max_queued = max_queued
        self.faults = faults or FaultDelays()
        self.stats = DecodeStats()
        self._stages: dict[str, Stage] = {}
        self._pending: dict[int, PendingKV] = {}
        self._reservation_ids = itertools.count(1)
        self._channels: dict[str, grpc.aio.Channel] = {}
        runner = engine.engine.model_runner
        self._runner = runner
        self.receiver = KVReceiver(
            node_id,
            store_host,
            store_port,
            runner.device,
            on_transfer=self._on_transfer,
            on_peer_failed=self._on_peer_failed,
            timeout_s=transfer_timeout_s,
        )

    # ----------------------------------------------------------- requests
    async def decode(
        self, req: internal_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        rid = req.request_id
        params = sampling_params_from_proto(req.sampling)
        prompt = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        stream = RequestStream()
        usage = pdserve_pb2.Usage(decode_node=self.node_id)
        remote = req.HasField("prefill") and params.n == 1 and params.prompt_logprobs is None
        self.stats.requests += 1
        self._stages[rid] = Stage.QUEUED
        try:
            if remote:
                reservation = await asyncio.wrap_future(
                    self.engine.add(
                        rid, stream.sink, lambda e: e.reserve_request(rid, prompt, params)
                    )
                )
                if reservation is None:
                    self.engine.detach(rid)
                    self.stats.rejected += 1
                    raise NoCapacity(f"decode node {self.node_id} has no room for this request now")
                usage.prefill_node = req.prefill.node_id
                self._stages[rid] = Stage.PREFILL
                reply = await self._remote_prefill(req, reservation, deadline)
                replied = time.monotonic()
                usage.timing.prefill_queue_ms = reply.queue_ms
                usage.timing.prefill_compute_ms = reply.compute_ms
                usage.timing.kv_transfer_ms = reply.transfer_ms
                self.stats.remote_prefills += 1
            else:
                await asyncio.wrap_future(
                    self.engine.add(
                        rid, stream.sink, lambda e: self._admit_local(e, rid, prompt, params)
                    )
                )
                self.stats.local_prefills += 1
            state = StreamState()
            async for out in stream:
                self._stages[rid] = Stage.DECODE
                if (
                    remote
                    and not state.completion_tokens
                    and not usage.timing.decode_first_output_ms
                ):
                    usage.timing.decode_first_output_ms = (time.monotonic() - replied) * 1e3
                usage.cached_tokens = out.num_cached_tokens
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
            self._stages.pop(rid, None)

    def _admit_local(self, engine: LLMEngine, rid: str, prompt, params) -> None:
        """On the engine thread: queue a request this node prefills itself, if the queue has room."""
        try:
            sched = engine.scheduler
            check_queue(len(sched.waiting), sched.num_free_slots, self.max_queued, self.node_id)
        except NoCapacity:
            self.stats.rejected += 1
            raise
        engine.add_request(rid, prompt, params)

    async def _remote_prefill(
        self, req: internal_pb2.DecodeRequest, reservation: Reservation, deadline: float | None
    ) -> internal_pb2.PrefillResponse:
        loop = asyncio.get_running_loop()
        peer = req.prefill.node_id
        reservation_id = next(self._reservation_ids)
        pending = PendingKV(req.request_id, reservation, peer, loop.create_future(), loop)
        self._pending[reservation_id] = pending
        epoch = self.receiver.expect(peer, reservation_id)
        destination = internal_pb2.KVDestination(
            node_id=self.node_id,
            store_host=self.receiver.host,
            store_port=self.receiver.port,
            channel_epoch=epoch,
            reservation_id=reservation_id,
            first_block=reservation.first_block,
            num_blocks=len(reservation.block_ids),
        )
        prefill_req = internal_pb2.PrefillRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            cache_salt=req.cache_salt,
            destination=destination,
        )
        stub = internal_pb2_grpc.PrefillNodeStub(self._channel(req.prefill.address))
        # The lease bounds how long the blocks stay reserved for this prefill
        # node, whatever the client's deadline: a stalled or dead node cannot
        # pin them, and the router can retry elsewhere (nothing was sent yet).
        lease_end = time.monotonic() + self.kv_lease_s
        end = lease_end if deadline is None else min(deadline, lease_end)
        try:
            try:
                resp = await stub.Prefill(prefill_req, timeout=max(0.0, end - time.monotonic()))
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED and end == deadline:
                    raise  # the client's own deadline: no retry
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.receiver.reset(peer)
                if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    self._expire(pending)
                    raise PrefillFailed(
                        peer, e.code(), f"no KV within the {self.kv_lease_s:g} s lease"
                    ) from e
                raise PrefillFailed(peer, e.code(), e.details() or e.code().name) from e
            self._stages[req.request_id] = Stage.TRANSFER
            try:
                await asyncio.wait_for(pending.landed, max(0.0, end - time.monotonic()))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                self._expire(pending)
                raise PrefillFailed(
                    peer, grpc.StatusCode.DEADLINE_EXCEEDED, "the KV did not land within the lease"
                ) from None
            except TransferError as e:
                raise PrefillFailed(peer, grpc.StatusCode.UNAVAILABLE, str(e)) from e
            if self.verify_transfers and pending.digest != resp.kv_checksum:
                self.stats.checksum_mismatches += 1
                raise TransferError("the KV that landed differs from what the prefill node sent")
            self._stages[req.request_id] = Stage.ADMISSION
            if delay := self.faults.get(FaultPoint.DECODE_BEFORE_COMMIT):
                await asyncio.sleep(delay)
            await asyncio.wrap_future(self.engine.call(lambda e: self._commit(e, pending, resp)))
            return resp
        finally:
            self.receiver.unexpect(peer, reservation_id)
            with pending.lock:
                if pending.state in (TransferState.RESERVED, TransferState.LANDED):
                    pending.state = TransferState.ABORTED
            self._pending.pop(reservation_id, None)

    def _expire(self, pending: PendingKV) -> None:
        """The lease ran out: the reservation is reclaimed (its blocks are freed
        by the abort that follows); a transfer arriving later is dropped."""
        with pending.lock:
            if pending.state in (TransferState.RESERVED, TransferState.LANDED):
                pending.state = TransferState.EXPIRED
                self.stats.leases_expired += 1

    # ------------------------------------------------------ engine thread
    def _commit(
        self, engine: LLMEngine, pending: PendingKV, resp: internal_pb2.PrefillResponse
    ) -> None:
        with pending.lock:
            if pending.state is not TransferState.LANDED:
                raise TransferError(f"reservation of {pending.request_id} is {pending.state.name}")
            if pending.landed_event is not None:
                torch.cuda.current_stream().wait_event(pending.landed_event)
            lp = (
                token_logprobs_from_proto(resp.first_logprobs)
                if resp.HasField("first_logprobs")
                else None
            )
            engine.commit_request(pending.request_id, resp.first_token_id, lp, resp.cached_tokens)
            pending.state = TransferState.COMMITTED

    def _abort(self, engine: LLMEngine, rid: str, stage: Stage) -> None:
        req = engine.requests.get(rid)
        if stage is Stage.QUEUED and req is not None and req.first_scheduled_time is not None:
            stage = Stage.PREFILL  # a local prefill under way (only the engine knows)
        self.stats.aborts.aborted(stage)
        for pending in list(self._pending.values()):
            if pending.request_id == rid and pending.landed_event is not None:
                # Blocks a landing may still be writing go back only after it ends.
                torch.cuda.current_stream().wait_event(pending.landed_event)
        engine.abort_request(rid)

    # --------------------------------------------------- receiver thread
    def _on_transfer(
        self, peer: str, header: TransferHeader, payload: torch.Tensor, stream
    ) -> None:
        pending = self._pending.get(header.reservation_id)
        if pending is None:
            self.stats.late_transfers += 1
            logger.info(
                "dropped a KV transfer for reservation %d, which is gone", header.reservation_id
            )
            return
        with pending.lock:
            if pending.state is not TransferState.RESERVED:
                self.stats.late_transfers += 1
                return
            blocks = pending.reservation.blocks_to_fill
            expected = len(blocks) * self._runner.kv_block_bytes
            if header.num_blocks != len(blocks) or header.num_bytes != expected:
                pending.state = TransferState.FAILED
                pending.resolve(
                    TransferError(
                        f"transfer for {pending.request_id} has {header.num_blocks} blocks / "
                        f"{header.num_bytes} bytes, the reservation needs {len(blocks)} / {expected}"
                    )
                )
                return
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        if blocks:
                            self._runner.scatter_kv(blocks, payload)
                        pending.landed_event = torch.cuda.Event()
                        pending.landed_event.record(stream)
                elif blocks:
                    self._runner.scatter_kv(blocks, payload)
                if self.verify_transfers:
                    landed = (
                        self._runner.gather_kv(blocks)
                        if blocks
                        else torch.empty(0, dtype=self._runner.dtype)
                    )
                    pending.digest = checksum(landed)
            except Exception as e:
                pending.state = TransferState.FAILED
                pending.resolve(
                    TransferError(f"could not place the KV of {pending.request_id}: {e}")
                )
                return
            pending.state = TransferState.LANDED
            self.stats.transfers_landed += 1
            self.stats.bytes_received += header.num_bytes
        pending.resolve()

    def _on_peer_failed(self, peer: str, error: Exception) -> None:
        for pending in list(self._pending.values()):
            with pending.lock:
                if pending.peer != peer or pending.state is not TransferState.RESERVED:
                    continue
                pending.state = TransferState.FAILED
            self.stats.transfer_failures += 1
            pending.resolve(TransferError(f"KV channel from {peer} failed: {error}"))

    # ---------------------------------------------------------------- misc
    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = make_channel(address, self.tls, CLIENT_OPTIONS)
        return channel

    async def close(self) -> None:
        self.receiver.close()
        for channel in self._channels.values():
            await channel.close()
