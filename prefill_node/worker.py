"""The prefill node's engine: prompts in, first token out, KV streamed to a decode node.

Life cycle of a request on a prefill node:

1. ``Prefill`` arrives from a decode node, naming the decode node's transfer
   endpoint, the channel epoch, the reservation and the first block it needs.
2. The request joins the engine (batched and chunked with other prefills, its
   prefix served from this node's cache) as a one-token generation whose blocks
   are held when it finishes (``hold_kv``), and its transfer is opened on the
   streamer (prefill_node/kv_stream.py), which the engine tells about every
   step's layers.
3. While the prompt computes, every step streams its blocks: headers with the
   step's first chunk (on a CPU before the step), a chunk per
   ``--kv-stream-layers`` layers right after those layers ran, sent by the sender's thread (its own stream) while
   the next layers compute (with ``--kv-stream-last-layers N`` only the last N
   layers do; the layers before them go as one chunk once they all ran). After
   the prompt's last layer only its last chunk is left to send.
4. When the first token is sampled and the last chunk is out, the node
   releases the held blocks and replies with the first token, its cache hit,
   the time spent queueing and computing, and the part of the transfer left
   after the last layer.
5. Whatever happens, the stream of the reservation ends with an end header
   (protocol.py). Cancellation (the decode node gave up) aborts the request and
   frees its blocks, held or not; a failed transfer fails the RPC at once, even
   mid-compute (the decode node frees its reservation).
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
from common.metrics.phases import PhaseHistograms, PromptPhases
from common.runtime.reliability import (
    AbortCounters,
    FaultDelays,
    FaultPoint,
    NoCapacity,
    Stage,
    StaleChannel,
    check_queue,
    deadline_passed,
)
from common.wire import sampling_params_from_proto, token_ids_of, token_logprobs_to_proto
from engine.copy_engine import CopyEngine
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.request_stream import RequestStream
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.sequence import FinishReason
from prefill_node.kv_stream import KVStreamer
from prefill_node.late_blocks import LateBlocks, LateBoard, check_blocks
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
    ) -> None:
        self.node_id = node_id
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
        # Prefills whose blocks follow, on any session (prefill_node/late_blocks.py).
        self.board = LateBoard(self._orphaned)
        # Decode node -> where its latest own Prefill said its KV goes (the
        # channel epoch with it): a router's Prefill (dispatched) uses that.
        self._dests: dict[str, Destination] = {}
        # A router may send Prefills here (the first token then goes on the KV
        # channel, which needs one rank; --verify-kv needs the decode node's own).
        self.takes_dispatched = tp.size == 1 and not verify_transfers
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
        )
        llm_engine.observe_kv_writes(self.streamer)
        self.stats.copier = self.streamer.copier
        if tp.size > 1:
            # The other ranks' senders and streamers (prefill_node/tp_rank.py).
            setup = {
                "node_id": node_id,
                "timeout_s": sender.timeout_s,
                "layers_per_chunk": layers_per_chunk,
                "last_layers": last_layers,
            }
            engine.call(lambda e: e.call_workers("setup", setup)).result()
        if step_delay := self.faults.get(FaultPoint.PREFILL_STEP):
            engine.after_step.append(lambda outputs: time.sleep(step_delay))

    def late_blocks(self, req: internal_pb2.PrefillRequest) -> LateBlocks:
        """Where a Prefill started with ``blocks_follow`` waits for its blocks (a
        dispatched one's must name the channel it will send on: the decode
        node's latest own Prefill's, resolved once, here)."""
        num_tokens = len(req.prompt_token_ids)
        if not req.dispatched:
            return LateBlocks(num_tokens, self.block_size)
        known = self._dests.get(req.destination.node_id)  # None: refused in ``prefill``
        return LateBlocks(num_tokens, self.block_size, known, req.destination.reservation_id)

    def _orphaned(self, dest: internal_pb2.KVDestination) -> None:
        """A dispatched Prefill's blocks went to no Prefill that sends (another
        channel, a Prefill that failed, ended or never came): the decode node
        expects the reservation's stream there, so it ends there. That channel is
        the decode node's now: the next router's Prefill for it sends on it."""
        target = self._remember(dest)
        self.engine.call(lambda e: self.streamer.end(target, dest.reservation_id))

    def _remember(self, dest: internal_pb2.KVDestination) -> Destination:
        """The decode node's channel as it names it now (a router's next Prefill uses it)."""
        target = self._dests[dest.node_id] = Destination(
            dest.node_id,
            dest.store_host,
            dest.store_port,
            dest.channel_epoch,
            max(1, dest.tensor_parallel_size),
            dest.header_block,
        )
        return target

    def _target(self, req: internal_pb2.PrefillRequest, late: LateBlocks | None) -> Destination:
        """Where the KV goes: the decode node's own Prefill says so (and is
        remembered); a router's (dispatched) goes on the channel the decode
        node's latest Prefill named when it came (StaleChannel where there is none)."""
        dest = req.destination
        if req.dispatched:
            if not self.takes_dispatched:
                raise ValueError(
                    "this prefill node takes no Prefill from a router (tensor parallelism "
                    "or --verify-kv): its decode node sends it"
                )
            if not req.blocks_follow or not req.first_token_on_kv:
                raise ValueError("a router's Prefill has its blocks follow and its token on KV")
            if late is None or late.target is None:
                raise StaleChannel(f"no KV channel to decode node {dest.node_id} yet")
            return late.target
        return self._remember(dest)

    async def prefill(
        self,
        req: internal_pb2.PrefillRequest,
        deadline: float | None,
        late: LateBlocks | None = None,
    ) -> internal_pb2.PrefillResponse:
        """``late``: the blocks of a request with ``blocks_follow``, set by its
        session when they come."""
        start = time.monotonic()  # the reply's node_ms: all of this node's part
        rid = req.request_id
        ids = token_ids_of(req.prompt_token_ids)
        dest = req.destination
        target = self._target(req, late)
        params = prefill_params(sampling_params_from_proto(req.sampling))
        params.resume_offset = req.resume_offset  # a migrated stream's seeded draws
        prompt = {"prompt_token_ids": ids}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        stream = RequestStream()
        sending = False
        ticket: TransferTicket | None = None
        try:
            self._check_destination(len(ids), dest, req.blocks_follow, late)
            ticket = await asyncio.wrap_future(
                self.engine.add(
                    rid,
                    stream.sink,
                    lambda e: self._admit(
                        e, rid, prompt, params, target, dest, deadline, late, req.first_token_on_kv
                    ),
                )
            )
            transfer = asyncio.wrap_future(ticket.done)
            # Retrieved even when nobody awaits it any more (no warning at exit).
            transfer.add_done_callback(lambda f: f.cancelled() or f.exception())
            out = await self._computed(stream, transfer)
            if out.outputs[0].finish_reason == FinishReason.ABORT.value:
                raise RuntimeError("the prefill was aborted")
            first = out.outputs[0].token_ids[0]
            sending = True
            try:
                report: TransferReport = await transfer
            except Exception:
                self.stats.transfers_failed += 1
                raise
        except NoCapacity:
            raise  # refused before anything was queued
        except ValueError:
            if ticket is None:
                raise  # refused (bad destination or prompt) before anything was queued
            self.engine.call(lambda e: self._abort(e, rid, sending))
            raise
        except BaseException:
            # Cancelled, failed or refused: free whatever the request holds.
            if deadline_passed(deadline):
                self.stats.aborts.deadline_exceeded += 1
            self.engine.call(lambda e: self._abort(e, rid, sending))
            raise
        finally:
            if late is not None:
                # Wakes the engine thread if it waits for them (a no-op once they came).
                late.end()
            self.stats.requests += 1
            # Exactly one end header per Prefill, queued on the engine thread
            # behind whatever the request queued (an admission still pending
            # included), so that it follows all of the request's segments. A
            # router's Prefill whose blocks did not come (or fit) has none here:
            # the board ends its stream on the channel its blocks name, if they
            # come (the one the Prefill names may not be the decode node's).
            end = target if not req.dispatched or (late is not None and late.came) else None
            self.engine.call(lambda e: self._finish(e, rid, end, dest.reservation_id))
        if delay := self.faults.get(FaultPoint.PREFILL_REPLY):
            await asyncio.sleep(delay)
        self.stats.transferred(report.num_bytes, report.wire_s)
        phases = PromptPhases.of(out.metrics)
        if phases is not None:  # always, with a first token; never a made-up zero
            self.stats.phases.observe(phases)
        else:
            phases = PromptPhases(0.0, 0.0)
        resp = internal_pb2.PrefillResponse(
            first_token_id=first,
            cached_tokens=out.num_cached_tokens,
            queue_ms=phases.queue_s * 1e3,
            compute_ms=phases.prefill_s * 1e3,
            transfer_ms=report.exposed_s * 1e3,
            transfer_bytes=report.num_bytes,
            kv_checksum=report.digest,
        )
        if out.outputs[0].logprobs:
            resp.first_logprobs.CopyFrom(token_logprobs_to_proto(first, out.outputs[0].logprobs[0]))
        resp.node_ms = (time.monotonic() - start) * 1e3
        return resp

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

    def _check_destination(
        self,
        num_tokens: int,
        dest: internal_pb2.KVDestination,
        blocks_follow: bool,
        late: LateBlocks | None,
    ) -> None:
        if self.verify_transfers and max(dest.tensor_parallel_size, 1) > 1:
            raise ValueError(
                "--verify-kv checks transfers between nodes of tensor-parallel size 1 only; "
                f"decode node {dest.node_id} has {dest.tensor_parallel_size} ranks"
            )
        if blocks_follow:
            if late is None:
                raise ValueError("a Prefill whose blocks follow comes on a PrefillSession only")
            return  # its blocks are checked when they come (LateBlocks.set)
        check_blocks(dest.first_block, dest.num_blocks, num_tokens, self.block_size)

    def _admit(
        self,
        engine: LLMEngine,
        rid: str,
        prompt,
        params: SamplingParams,
        target: Destination,
        dest: internal_pb2.KVDestination,
        deadline: float | None,
        late: LateBlocks | None,
        dest_wants_token: bool,
    ) -> TransferTicket:
        """On the engine thread: queue the prompt if the queue has room, open its stream."""
        try:
            check_queue(*engine.queue_room(), self.max_queued, self.node_id)
        except NoCapacity:
            self.stats.rejected += 1
            raise
        engine.add_request(rid, prompt, params, hold_kv=True)
        return self.streamer.open(
            rid,
            target,
            dest.reservation_id,
            dest.first_block,
            dest.num_blocks,
            deadline if deadline is not None else time.monotonic() + self.sender.timeout_s,
            self.verify_transfers,
            late,
            first_token=dest_wants_token,
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
        self, engine: LLMEngine, rid: str, target: Destination | None, reservation_id: int
    ) -> None:
        """On the engine thread: the held blocks (if any are left) go back to the
        pool and the reservation's stream ends."""
        engine.release_held(rid)
        self.streamer.finish(rid, target, reservation_id)
