"""The decode node's request path (asyncio): admit, have the prompt filled,
decode, stream. The KV landing (reservations, transfer callbacks, lease
expiry, commit) is decode_node/kv_landing.py; a request whose prompt a prefill
node computes goes through decode_node/remote_prefill.py.

Life cycle of a request on a decode node:

1. It arrives from the router (a ``start`` on the router's DecodeSession) with
   the prompt's token ids and, usually, the prefill node computing it (whose
   Prefill the router sent at the same time). Without one (or for n > 1, or
   prompt logprobs) the request simply joins this node's engine, which
   prefills it itself.
2. Otherwise the prompt's KV and first token come from the prefill node
   (``RemotePrefill``: reserve, send the blocks, land, commit); the first
   token goes out at once.
3. Each engine step yields at most one message per request, relayed as
   ``GenerateResponse`` deltas; the stream ends with the Final message.
Any failure or cancellation aborts the engine request (freeing reserved or
running blocks); the router cancels the Prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.grpc_server import CLIENT_OPTIONS
from common.metrics.phases import PromptPhases, phase_spans
from common.runtime.node_lora import NodeAdapters
from common.runtime.reliability import (
    FaultDelays,
    NoCapacity,
    Stage,
    check_queue,
    deadline_passed,
)
from common.sessions.prefill import PrefillSessionClient
from common.tls import NO_TLS, TLSConfig, make_channel
from common.tracing import Tracing
from common.wire import (
    StreamState,
    output_to_responses,
    sampling_params_from_proto,
    token_ids_of,
)
from decode_node.kv_landing import KVLanding
from decode_node.remote_prefill import PrefillState, RemotePrefill
from decode_node.stats import DecodeStats
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine, Reservation
from engine.lora.request import LoRARequest
from engine.request_stream import RequestStream, settled
from proto import internal_pb2, pdserve_pb2

logger = logging.getLogger(__name__)

# Where a disaggregated request stood when it was aborted (the abort counters).
_STAGE_OF = {
    PrefillState.RESERVING: Stage.QUEUED,
    PrefillState.BLOCKS_SENT: Stage.PREFILL,
    PrefillState.LANDED: Stage.ADMISSION,
    PrefillState.COMMITTED: Stage.DECODE,
    PrefillState.FAILED: Stage.PREFILL,
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
        tracing: Tracing | None = None,
        connect_timeout_s: float = 5.0,
        adapters: NodeAdapters | None = None,
    ) -> None:
        if not kv_lease_s > 0:
            raise ValueError(f"the KV lease must be > 0 seconds, got {kv_lease_s}")
        self.node_id = node_id
        self.adapters = adapters or NodeAdapters()  # its LoRA adapters, by name
        self.tls = tls  # for the PrefillSessions
        self.engine = engine
        self.kv_lease_s = kv_lease_s
        self.max_queued = max_queued
        self.faults = faults or FaultDelays()
        self.tracing = tracing or Tracing.off()
        self.stats = DecodeStats()
        self._stages: dict[str, Stage] = {}  # local prefills and decoding
        self._remote: dict[str, RemotePrefill] = {}  # disaggregated requests until committed
        self._channels: dict[str, grpc.aio.Channel] = {}
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
            connect_timeout_s=connect_timeout_s,
            wait_s=kv_lease_s,
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
        lora = self.adapters.request_of(req.lora, self.node_id)
        stream = RequestStream()
        usage = pdserve_pb2.Usage(decode_node=self.node_id)
        remote = req.HasField("prefill") and params.n == 1 and params.prompt_logprobs is None
        self.stats.requests += 1
        self._stages[rid] = Stage.QUEUED
        landed = 0.0
        phases: list[tuple[str, float, float]] = []  # a local prefill's, for the span
        status = "OK"
        try:
            if remote:
                usage.prefill_node = req.prefill.node_id
                landed = await self._remote_prefill(
                    req, stream, prompt, params, lora, deadline, usage
                )
                self._remote_timings(rid, usage, arrived, landed)
            else:
                await asyncio.wrap_future(
                    self.engine.add(
                        rid, stream.sink, lambda e: self._admit_local(e, rid, prompt, params, lora)
                    )
                )
                self.stats.local_prefills += 1
            async for resp in self._stream(rid, stream, usage, landed, phases):
                yield resp
        except NoCapacity:
            status = "RESOURCE_EXHAUSTED"
            raise  # nothing was admitted
        except BaseException as e:
            status = type(e).__name__
            stage = self._stage(rid)
            if deadline_passed(deadline):
                self.stats.aborts.deadline_exceeded += 1
            self.engine.call(lambda e: self._abort(e, rid, stage))
            raise
        finally:
            self._stages.pop(rid, None)
            self._remote.pop(rid, None)
            self._trace(req, arrived, landed, usage, phases, status)

    async def _stream(self, rid: str, stream: RequestStream, usage, landed: float, spans: list):
        """The request's messages, from its outputs until the Final. ``landed``:
        when a remote prefill's KV landed (0: this node prefilled the prompt,
        whose phases go into ``spans``)."""
        state = StreamState()
        timed = bool(landed)  # a remote prefill's phases are the prefill node's
        async for out in stream:
            self._stages[rid] = Stage.DECODE
            if landed and not state.completion_tokens and not usage.timing.decode_first_output_ms:
                usage.timing.decode_first_output_ms = (time.monotonic() - landed) * 1e3
            if not timed and (phases := PromptPhases.of(out.metrics)) is not None:
                timed = True
                self.stats.phases.observe(phases)
                usage.timing.prefill_queue_ms = phases.queue_s * 1e3
                usage.timing.prefill_compute_ms = phases.prefill_s * 1e3
                spans.extend(phase_spans(out.metrics))
            usage.cached_tokens = out.num_cached_tokens
            for resp in output_to_responses(out, rid, state, usage):
                yield resp

    async def _remote_prefill(self, req, stream, prompt, params, lora, deadline, usage) -> float:
        """The prompt's KV and first token from the prefill node, committed
        (decode_node/remote_prefill.py); returns when they landed."""
        rid = req.request_id
        if not req.reservation_id:
            raise ValueError("a request with a prefill node needs its reservation id")
        # The lease bounds how long the blocks stay reserved for this prefill
        # node, whatever the client's deadline: a stalled or dead node cannot
        # pin them, and the router can retry elsewhere (nothing was sent yet).
        lease_end = time.monotonic() + self.kv_lease_s
        end = lease_end if deadline is None else min(deadline, lease_end)
        remote = self._remote[rid] = RemotePrefill(
            req, self.landing, self._session(req.prefill), self.node_id, end, deadline
        )
        await remote.run(
            lambda: self._reserve(rid, stream, prompt, params, lora), self.engine, self.faults
        )
        self.stats.remote_prefills += 1
        return time.monotonic()

    def _trace(self, req, arrived: float, landed: float, usage, phases: list, status: str):
        """The request's span on this node (common/tracing.py), recorded as it ends."""
        if not self.tracing.enabled:
            return
        t = usage.timing
        if landed:  # a remote prefill: admission, the wait for the KV, the first output
            sent = arrived + t.decode_admit_ms / 1e3
            phases = [
                ("admission", arrived, sent),
                ("kv_wait", sent, sent + t.kv_wait_ms / 1e3),
                ("first_output", landed, landed + t.decode_first_output_ms / 1e3),
            ]
        attributes = {
            "pdserve.request_id": req.request_id,
            "pdserve.status": status,
            "pdserve.prefill_node": usage.prefill_node or None,
            "pdserve.cached_tokens": usage.cached_tokens,
            "pdserve.completion_tokens": usage.completion_tokens,
        }
        self.tracing.record(
            "decode", req.traceparent, arrived, time.monotonic(), attributes, phases
        )

    def _remote_timings(self, rid: str, usage, arrived: float, landed: float) -> None:
        self._remote[rid].timings(usage, arrived, landed)
        del self._remote[rid]  # committed: the request decodes like any other now
        self._stages[rid] = Stage.DECODE

    def _stage(self, rid: str) -> Stage:
        remote = self._remote.get(rid)
        if remote is not None:
            return _STAGE_OF[remote.state]
        return self._stages.get(rid, Stage.QUEUED)

    async def _reserve(
        self, rid: str, stream: RequestStream, prompt, params, lora: LoRARequest | None
    ) -> Reservation:
        """The prompt's blocks, from this node's own prefix-cache hit on
        (NoCapacity when there is no room)."""
        # Inline: on this thread if the engine thread is idle (two hand-overs
        # between threads fewer).
        reservation = await settled(
            self.engine.add(
                rid,
                stream.sink,
                lambda e: e.reserve_request(rid, prompt, params, lora_request=lora),
                inline=True,
            )
        )
        if reservation is None:
            self.engine.detach(rid)
            self.stats.rejected += 1
            raise NoCapacity(f"decode node {self.node_id} has no room for this request now")
        return reservation

    def _admit_local(
        self, engine: LLMEngine, rid: str, prompt, params, lora: LoRARequest | None
    ) -> None:
        """On the engine thread: queue a request this node prefills itself, if the queue has room."""
        try:
            check_queue(*engine.queue_room(), self.max_queued, self.node_id)
        except NoCapacity:
            self.stats.rejected += 1
            raise
        engine.add_request(rid, prompt, params, lora_request=lora)

    def _session(self, node: internal_pb2.NodeRef) -> PrefillSessionClient:
        """This node's PrefillSession with ``node`` (opened by its first use)."""
        session = self._sessions.get(node.address)
        if session is None:
            # A session that ends tells what the prefill node's failure would:
            # the node died, restarted or stalled. Its KV channels move to a new
            # epoch then, even with no transfer in flight to break: the first
            # transfer from a restarted node must not rendezvous on the dead one's.
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
