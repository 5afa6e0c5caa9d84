"""The prefill node's engine: prompts in, first token out, KV streamed to a decode node.

Life cycle of a request on a prefill node:

1. A Prefill arrives from the router on its PrefillSession, naming the
   decode node and the reservation id; beside it the decode node reserves the
   prompt's blocks and sends them, with its KV channel, on its own session
   (prefill_node/destinations.py: either may come first).
2. The request joins the engine at once (batched and chunked with other
   prefills, its prefix served from this node's cache) as a one-token
   generation whose blocks are held when it finishes (``hold_kv``), and its
   transfer is opened on the streamer (prefill_node/kv_stream.py), which the
   engine tells about every step's layers.
3. While the prompt computes, every step streams its blocks, once the decode
   node's blocks came: headers with the step's first chunk (on a CPU before the
   step), a chunk per ``--kv-stream-layers`` layers right after those layers
   ran, sent by the sender's thread (its own stream) while the next layers
   compute (with ``--kv-stream-last-layers N`` only the last N layers do; the
   layers before them go as one chunk once they all ran). After the prompt's
   last layer only its last chunk is left, then the first token, from the
   device behind the sampling (prefill_node/first_tokens.py).
4. When the last chunk and the token are out, the node releases the held
   blocks and replies to the router with its own figures (cache hit, queue,
   compute, the transfer left after the last layer); nothing waits for them.
5. Whatever happens, the stream of the reservation ends with an end header
   (protocol.py). Cancellation (the router gave up) aborts the request and
   frees its blocks, held or not; a failed transfer fails the Prefill at once,
   even mid-compute (the decode node frees its reservation).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from common.kv_transfer import (
    Destination,
    KVSender,
    TransferReport,
    TransferTicket,
)
from common.metrics.histogram import KV_BANDWIDTH_BUCKETS, KV_TRANSFER_BUCKETS, Histogram
from common.metrics.phases import PhaseHistograms, PromptPhases, phase_spans
from common.runtime.node_lora import NodeAdapters
from common.runtime.reliability import (
    AbortCounters,
    FaultDelays,
    FaultPoint,
    NoCapacity,
    Stage,
    check_queue,
    deadline_passed,
)
from common.tracing import Tracing
from common.wire import sampling_params_from_proto, token_ids_of
from engine.copy_engine import CopyEngine
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sequence import FinishReason
from prefill_node.destinations import DestinationBoard, PendingDestination
from prefill_node.kv_stream import KVStreamer
from proto import internal_pb2

logger = logging.getLogger(__name__)

_NO_TRANSFER = TransferReport(0, 0.0, 0.0, b"")  # what a Prefill that sent nothing reports


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What a prefill node runs: one token, no text (stop strings are the decode
    node's business; min_tokens still masks EOS for the first token)."""
    return params.clone(
        n=1,
        max_tokens=1,
        min_tokens=min(params.min_tokens, 1),
        stop=None,
        include_stop_str_in_output=False,
        detokenize=False,
        prompt_logprobs=None,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


@dataclass(slots=True)
class PrefillStats:
    requests: int = 0
    transfers: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0
    transfer_us: int = 0  # time chunks spent on the wire, summed
    rejected: int = 0  # refused: queue full (RESOURCE_EXHAUSTED)
    aborts: AbortCounters = field(default_factory=AbortCounters)
    # Per transfer: seconds its chunks spent on the wire (summed), bytes/s over that.
    transfer_s: Histogram = field(default_factory=lambda: Histogram(KV_TRANSFER_BUCKETS))
    bandwidth: Histogram = field(default_factory=lambda: Histogram(KV_BANDWIDTH_BUCKETS))
    # Per Prefill call: its prompt's queue and prefill time here.
    phases: PhaseHistograms = field(default_factory=PhaseHistograms)
    # The streamer's copy engines (a GPU's; rank 0's of a tensor-parallel node).
    copier: CopyEngine | None = None

    def transferred(self, num_bytes: int, seconds: float) -> None:
        self.transfers += 1
        self.bytes_sent += num_bytes
        self.transfer_us += int(seconds * 1e6)
        self.transfer_s.observe(seconds)
        if num_bytes and seconds > 0:  # an empty push (all blocks cached there) has no rate
            self.bandwidth.observe(num_bytes / seconds)

    def histograms(self) -> dict[str, Histogram]:
        return {
            "kv_transfer_seconds": self.transfer_s,
            "kv_transfer_bandwidth": self.bandwidth,
            **self.phases.histograms(),
        }

    def counters(self) -> dict[str, int]:
        return {
            **self.aborts.counters(),
            "rejected": self.rejected,
            "requests_total": self.requests,
            "kv_transfers": self.transfers,
            "kv_transfer_failures": self.transfers_failed,
            "kv_transfer_bytes": self.bytes_sent,
            "kv_transfer_us": self.transfer_us,
            "kv_gathers_copy_engine": self.copier.gathers if self.copier is not None else 0,
        }


class PrefillWorker:
    def __init__(
        self,
        node_id: str,
        engine: EngineThread,
        sender: KVSender,
        verify_transfers: bool = False,
        max_queued: int = 0,
        faults: FaultDelays | None = None,
        layers_per_chunk: int = 1,
        last_layers: int = 0,
        tracing: Tracing | None = None,
        adapters: NodeAdapters | None = None,
    ) -> None:
        self.node_id = node_id
        self.adapters = adapters or NodeAdapters()  # its LoRA adapters, by name
        self.tracing = tracing or Tracing.off()
        self.engine = engine
        self.sender = sender
        self.verify_transfers = verify_transfers
        self.max_queued = max_queued
        self.faults = faults or FaultDelays()
        self.stats = PrefillStats()
        llm_engine = engine.engine
        runner = llm_engine.model_runner
        self.block_size = runner.block_size
        tp = runner.tp
        # Where each running Prefill's KV goes, whichever session brought its blocks.
        self.board = DestinationBoard(self._orphaned)
        self.streamer = KVStreamer(
            runner.kv_cache,
            runner.block_size,
            sender,
            layers_per_chunk,
            num_kv_heads=runner.layout.num_kv_heads,
            last_layers=last_layers,
            tp_rank=tp.rank,
            tp_size=tp.size,
            call_workers=llm_engine.call_workers if tp.size > 1 else None,
            kv_scales=runner.kv_scales,
        )
        llm_engine.observe_kv_writes(self.streamer)
        self.stats.copier = self.streamer.copier
        if tp.size > 1:
            # The other ranks' senders and streamers (prefill_node/tp_rank.py).
            setup = {
                "node_id": node_id,
                "timeout_s": sender.timeout_s,
                "connect_timeout_s": sender.connect_timeout_s,
                "layers_per_chunk": layers_per_chunk,
                "last_layers": last_layers,
            }
            engine.call(lambda e: e.call_workers("setup", setup)).result()
        if step_delay := self.faults.get(FaultPoint.PREFILL_STEP):
            engine.after_step.append(lambda outputs: time.sleep(step_delay))

    def pending_destination(self, req: internal_pb2.PrefillRequest) -> PendingDestination:
        """Where a Prefill's KV goes, once the decode node's blocks came."""
        return PendingDestination(req, self.block_size)

    def _orphaned(self, dest: Destination, reservation_id: int) -> None:
        """Blocks that went to no Prefill that sends (one that failed, ended or
        never came, or blocks that did not fit): the decode node expects the
        reservation's stream on that channel, so it ends there."""
        self.engine.call(lambda e: self.streamer.end(dest, reservation_id))

    async def prefill(
        self,
        req: internal_pb2.PrefillRequest,
        deadline: float | None,
        pending: PendingDestination,
    ) -> internal_pb2.PrefillResponse:
        """Compute ``req``'s prompt and send its KV and first token where
        ``pending`` says, once the decode node's blocks came (its session sets
        them); the reply holds this node's figures."""
        start = time.monotonic()  # the reply's node_ms: all of this node's part
        self._check(req)
        out, report, status = None, _NO_TRANSFER, "OK"
        try:
            out, report = await self._computed_and_sent(req, deadline, pending)
            return await self._reply(out, report, start)
        except BaseException as e:
            status = type(e).__name__
            raise
        finally:
            self._trace(req, start, out, report, status)

    async def _computed_and_sent(
        self, req: internal_pb2.PrefillRequest, deadline: float | None, pending
    ) -> tuple[RequestOutput, TransferReport]:
        """The prompt's final output once its KV and first token are out."""
        rid = req.request_id
        params = prefill_params(sampling_params_from_proto(req.sampling))
        params.resume_offset = req.resume_offset  # a migrated stream's seeded draws
        prompt = {"prompt_token_ids": token_ids_of(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        lora = self.adapters.request_of(req.lora, self.node_id)
        stream = RequestStream()
        sending, ticket, report = False, None, _NO_TRANSFER
        try:
            ticket = await asyncio.wrap_future(
                self.engine.add(
                    rid,
                    stream.sink,
                    lambda e: self._admit(e, rid, prompt, params, lora, pending, deadline),
                )
            )
            transfer = asyncio.wrap_future(ticket.done)
            # Retrieved even when nobody awaits it any more (no warning at exit).
            transfer.add_done_callback(lambda f: f.cancelled() or f.exception())
            out = await self._computed(stream, transfer)
            if out.outputs[0].finish_reason == FinishReason.ABORT.value:
                raise RuntimeError("the prefill was aborted")
            sending = True
            report = await self._sent(transfer)
            return out, report
        except NoCapacity:
            raise  # refused before anything was queued
        except BaseException:
            # Cancelled, failed or refused: free whatever the request holds.
            if deadline_passed(deadline):
                self.stats.aborts.deadline_exceeded += 1
            if ticket is not None:
                self.engine.call(lambda e: self._abort(e, rid, sending))
            raise
        finally:
            self._ended(rid, pending, req.reservation_id, report.digest)

    async def _sent(self, transfer: asyncio.Future) -> TransferReport:
        try:
            return await transfer
        except Exception:
            self.stats.transfers_failed += 1
            raise

    def _ended(self, rid: str, pending: PendingDestination, reservation_id: int, digest) -> None:
        """Whatever became of the Prefill: its stream's end."""
        # Wakes the engine thread if it waits for the blocks (a no-op once they came).
        pending.end()
        self.stats.requests += 1
        # Exactly one end header per Prefill whose blocks came and fit, queued on
        # the engine thread behind whatever the request queued (an admission
        # still pending included), so that it follows all of the request's
        # segments. Blocks that did not come (or fit) have the board end their
        # stream, if they come.
        end = pending.destination if pending.came else None
        self.engine.call(lambda e: self._finish(e, rid, end, reservation_id, digest))

    def _trace(self, req, start: float, out, report: TransferReport, status: str) -> None:
        """The Prefill's span (common/tracing.py), recorded as it ends."""
        if not self.tracing.enabled:
            return
        attributes = {
            "pdserve.request_id": req.request_id,
            "pdserve.status": status,
            "pdserve.decode_node": req.decode_node_id,
            "pdserve.kv_bytes": report.num_bytes,
            "pdserve.kv_exposed_ms": report.exposed_s * 1e3,
            "pdserve.cached_tokens": out.num_cached_tokens if out is not None else None,
        }
        phases = phase_spans(out.metrics) if out is not None else []
        self.tracing.record("prefill", req.traceparent, start, time.monotonic(), attributes, phases)

    def _check(self, req: internal_pb2.PrefillRequest) -> None:
        """What makes a Prefill unservable here, before anything is queued (ValueError)."""
        if not req.reservation_id:
            raise ValueError("a Prefill needs the reservation id of its decode node's blocks")
        if not req.decode_node_id:
            raise ValueError("a Prefill needs its decode node's id")
        if self.verify_transfers and max(req.decode_tensor_parallel_size, 1) > 1:
            raise ValueError(
                "--verify-kv checks transfers between nodes of tensor-parallel size 1 only; "
                f"decode node {req.decode_node_id} has {req.decode_tensor_parallel_size} ranks"
            )

    async def _reply(self, out, report: TransferReport, start: float):
        """The Prefill's own figures, for the router (its token went on the KV channel)."""
        if delay := self.faults.get(FaultPoint.PREFILL_REPLY):
            await asyncio.sleep(delay)
        self.stats.transferred(report.num_bytes, report.wire_s)
        phases = PromptPhases.of(out.metrics)
        if phases is not None:  # always, with a first token; never a made-up zero
            self.stats.phases.observe(phases)
        else:
            phases = PromptPhases(0.0, 0.0)
        return internal_pb2.PrefillResponse(
            cached_tokens=out.num_cached_tokens,
            queue_ms=phases.queue_s * 1e3,
            compute_ms=phases.prefill_s * 1e3,
            transfer_ms=report.exposed_s * 1e3,
            transfer_bytes=report.num_bytes,
            node_ms=(time.monotonic() - start) * 1e3,
        )

    async def _computed(self, stream: RequestStream, transfer: asyncio.Future):
        """The request's final output; a transfer that fails first fails it at once."""
        final = asyncio.ensure_future(stream.final())
        try:
            await asyncio.wait({final, transfer}, return_when=asyncio.FIRST_COMPLETED)
            if transfer.done() and not transfer.cancelled() and transfer.exception():
                raise transfer.exception()
            return await final
        finally:
            final.cancel()

    def _admit(
        self,
        engine: LLMEngine,
        rid: str,
        prompt,
        params: SamplingParams,
        lora: LoRARequest | None,
        pending: PendingDestination,
        deadline: float | None,
    ) -> TransferTicket:
        """On the engine thread: queue the prompt if the queue has room, open its stream."""
        try:
            check_queue(*engine.queue_room(), self.max_queued, self.node_id)
        except NoCapacity:
            self.stats.rejected += 1
            raise
        engine.add_request(rid, prompt, params, hold_kv=True, lora_request=lora)
        return self.streamer.open(
            rid,
            pending,
            deadline if deadline is not None else time.monotonic() + self.sender.timeout_s,
            self.verify_transfers,
            -1 if params.logprobs is None else params.logprobs,
        )

    def _abort(self, engine: LLMEngine, rid: str, sending: bool) -> None:
        """On the engine thread, where the request's stage is known exactly."""
        req = engine.requests.get(rid)
        if sending:
            stage = Stage.TRANSFER
        elif req is not None and req.first_scheduled_time is None:
            stage = Stage.QUEUED
        else:
            stage = Stage.PREFILL  # computing, or computed with its blocks held
        self.stats.aborts.aborted(stage)
        engine.abort_request(rid)

    def _finish(
        self,
        engine: LLMEngine,
        rid: str,
        target: Destination | None,
        reservation_id: int,
        digest: bytes,
    ) -> None:
        """On the engine thread: the held blocks (if any are left) go back to the
        pool and the reservation's stream ends."""
        engine.release_held(rid)
        self.streamer.finish(rid, target, reservation_id, digest)
