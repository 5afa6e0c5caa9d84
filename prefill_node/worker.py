"""The prefill node's engine: prompts in, first token out, KV pushed to a decode node.

Life cycle of a request on a prefill node:

1. ``Prefill`` arrives from a decode node, naming the decode node's transfer
   endpoint, the channel epoch, the reservation and the first block it needs.
2. The request joins the engine (batched and chunked with other prefills, its
   prefix served from this node's cache) as a one-token generation whose blocks
   are held when it finishes (``hold_kv``).
3. When the first token is sampled, the engine thread gathers the blocks the
   decode node needs into one contiguous buffer (on the engine's stream, so the
   next step may reuse the blocks as soon as they are released) and releases
   them at once.
4. The sender thread pushes header + payload over the pair channel (its own
   stream); the reply carries the first token, the prefix-cache hit and the
   time spent queueing, computing and transferring.
5. Cancellation (the decode node gave up) aborts the request and frees its
   blocks, held or not; a failed transfer fails the RPC (the decode node frees
   its reservation).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from common.kv_transfer import Destination, KVSender, TransferHeader
from common.kv_transfer.checksum import checksum
from common.metrics.histogram import KV_BANDWIDTH_BUCKETS, KV_TRANSFER_BUCKETS, Histogram
from common.reliability import (
    AbortCounters,
    FaultDelays,
    FaultPoint,
    NoCapacity,
    Stage,
    check_queue,
    deadline_passed,
)
from common.wire import sampling_params_from_proto, token_logprobs_to_proto
from engine.engine_thread import EngineThread, RequestStream
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sequence import FinishReason
from proto import internal_pb2

logger = logging.getLogger(__name__)


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
    transfer_us: int = 0  # time spent sending, summed
    rejected: int = 0  # refused: queue full (RESOURCE_EXHAUSTED)
    aborts: AbortCounters = field(default_factory=AbortCounters)
    # Per transfer: seconds from queueing the payload to the peer having it, bytes/s.
    transfer_s: Histogram = field(default_factory=lambda: Histogram(KV_TRANSFER_BUCKETS))
    bandwidth: Histogram = field(default_factory=lambda: Histogram(KV_BANDWIDTH_BUCKETS))

    def transferred(self, num_bytes: int, seconds: float) -> None:
        self.transfers += 1
        self.bytes_sent += num_bytes
        self.transfer_us += int(seconds * 1e6)
        self.transfer_s.observe(seconds)
        if num_bytes and seconds > 0:  # an empty push (all blocks cached there) has no rate
            self.bandwidth.observe(num_bytes / seconds)

    def histograms(self) -> dict[str, Histogram]:
        return {"kv_transfer_seconds": self.transfer_s, "kv_transfer_bandwidth": self.bandwidth}

    def counters(self) -> dict[str, int]:
        return {
            **self.aborts.counters(),
            "rejected": self.rejected,
            "requests_total": self.requests,
            "kv_transfers": self.transfers,
            "kv_transfer_failures": self.transfers_failed,
            "kv_transfer_bytes": self.bytes_sent,
            "kv_transfer_us": self.transfer_us,
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
    ) -> None:
        self.node_id = node_id
        self.engine = engine
        self.sender = sender
        self.verify_transfers = verify_transfers
        self.max_queued = max_queued
        self.faults = faults or FaultDelays()
        self.stats = PrefillStats()
        if step_delay := self.faults.get(FaultPoint.PREFILL_STEP):
            engine.after_step.append(lambda outputs: time.sleep(step_delay))

    async def prefill(
        self, req: internal_pb2.PrefillRequest, deadline: float | None
    ) -> internal_pb2.PrefillResponse:
        rid = req.request_id
        ids = list(req.prompt_token_ids)
        params = prefill_params(sampling_params_from_proto(req.sampling))
        params.resume_offset = req.resume_offset  # a migrated stream's seeded draws
        prompt = {"prompt_token_ids": ids}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        stream = RequestStream()
        start = time.monotonic()
        sending = False
        try:
            await asyncio.wrap_future(
                self.engine.add(rid, stream.sink, lambda e: self._admit(e, rid, prompt, params))
            )
            out = await stream.final()
            if out.outputs[0].finish_reason == FinishReason.ABORT.value:
                raise RuntimeError("the prefill was aborted")
            first = out.outputs[0].token_ids[0]
            dest = req.destination
            if delay := self.faults.get(FaultPoint.PREFILL_BEFORE_SEND):
                await asyncio.sleep(delay)
            header_info = await asyncio.wrap_future(
                self.engine.call(lambda e: self._gather_and_send(e, rid, first, dest, deadline))
            )
            sending = True
            future, num_bytes, digest = header_info
            gathered = time.monotonic()
            try:
                await asyncio.wrap_future(future)
            except Exception:
                self.stats.transfers_failed += 1
                raise
            done = time.monotonic()
        except NoCapacity:
            raise  # refused before anything was queued
        except BaseException:
            # Cancelled, failed or refused: free whatever the request holds.
            if deadline_passed(deadline):
                self.stats.aborts.deadline_exceeded += 1
            self.engine.call(lambda e: self._abort(e, rid, sending))
            raise
        finally:
            self.stats.requests += 1
        self.stats.transferred(num_bytes, done - gathered)
        m = out.metrics
        scheduled = m.first_scheduled_time or m.arrival_time
        resp = internal_pb2.PrefillResponse(
            first_token_id=first,
            cached_tokens=out.num_cached_tokens,
            queue_ms=(scheduled - m.arrival_time) * 1e3,
            compute_ms=((m.first_token_time or scheduled) - scheduled) * 1e3,
            transfer_ms=(done - gathered) * 1e3,
            transfer_bytes=num_bytes,
            kv_checksum=digest,
        )
        logger.debug("prefill %s took %.1f ms", rid, (done - start) * 1e3)
        if out.outputs[0].logprobs:
            resp.first_logprobs.CopyFrom(token_logprobs_to_proto(first, out.outputs[0].logprobs[0]))
        return resp

    def _admit(self, engine: LLMEngine, rid: str, prompt, params: SamplingParams) -> None:
        """On the engine thread: queue the prompt if the queue has room."""
        try:
            check_queue(*engine.queue_room(), self.max_queued, self.node_id)
        except NoCapacity:
            self.stats.rejected += 1
            raise
        engine.add_request(rid, prompt, params, hold_kv=True)

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

    def _gather_and_send(
        self,
        engine: LLMEngine,
        rid: str,
        first_token: int,
        dest: internal_pb2.KVDestination,
        deadline: float | None,
    ):
        """On the engine thread: gather the decode node's blocks, release ours, queue the send."""
        seq = engine.take_held(rid)
        if seq is None:
            raise RuntimeError(f"request {rid} holds no KV (aborted?)")
        try:
            if len(seq.block_table) != dest.num_blocks:
                raise ValueError(
                    f"the decode node reserved {dest.num_blocks} blocks, the prompt has "
                    f"{len(seq.block_table)}: are both nodes on the same model and block size?"
                )
            blocks = seq.block_table[dest.first_block :]
            runner = engine.model_runner
            payload = runner.gather_kv(blocks) if blocks else torch.empty(0, dtype=runner.dtype)
            ready = None
            if payload.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            digest = checksum(payload) if self.verify_transfers else bytes(16)
        finally:
            # The gather is queued on the engine's stream before any later step,
            # so the blocks can go back to the pool now.
            engine.release_held(rid)
        num_bytes = payload.numel() * payload.element_size()
        header = TransferHeader(dest.reservation_id, len(blocks), num_bytes, first_token, digest)
        target = Destination(dest.node_id, dest.store_host, dest.store_port, dest.channel_epoch)
        future = self.sender.submit(target, header, payload, ready, deadline)
        return future, num_bytes, digest
