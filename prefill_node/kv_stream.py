"""The prefill node's KV streaming: an engine KV-write observer (engine/kv_writes.py).

For every step that computes tokens of a request being streamed, ``begin_step``
(engine thread, before the forward) decides which of its blocks the step
completes -- full blocks up to the step's last token, and on the prompt's last
step every block that is left -- skipping those the decode node already holds
(its own prefix cache: blocks before ``first_block``) and those sent by an
earlier step: one ``StepSegment`` per request. Each rank then sends its own KV
heads of them (``_emit``): per decode rank it pairs with (pairing.py), one
segment whose header names the global head range; a step's segments for one
decode rank form a group, whose headers are queued on the sender before the
step is launched -- on a GPU the group is prepared at the first layer's hook
and queued with the step's first chunk (``_emit`` says why). Then, as each
group of ``layers_per_chunk`` layers is done (``layer_done``), their KV of
those blocks and heads is gathered into a fresh buffer (on a GPU on a stream
of its own: ``_layer_done``) and queued as one chunk; the sender's thread puts
it on the wire while the next layers compute. After the prompt's last layer
only its last chunk is left, and the first token (first_tokens.py). With ``last_layers`` only a step's last layers
stream like this; the layers before them go as one chunk once they all ran
(``layer_spans`` says why).

Tensor parallelism: rank 0 plans (it has the scheduler's batch and the
requests' destinations) and hands each step's segments to the other ranks
(``call_workers("kv_step")``, before the step's own hand-off); their streamer
(prefill_node/tp_rank.py) is asked with no batch and emits its heads of the
same segments. ``finish`` ends a reservation's stream on every rank the same way.

The decode node's blocks and channel come after the Prefill, or beside it
(destinations.py): a step is planned without those still to come; on a GPU
its groups are prepared at the first due chunk's hook, once they came.

Chunked prefill: a block cut by a chunk boundary goes with the chunk that
fills it. Prefix hits go with the first segment; each layer's chunk is gathered
behind that layer, so a hit on blocks another prompt computes in the same step
is read once that layer has written them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.kv_transfer.channel import TransferError
from common.kv_transfer.pairing import kv_pairs, sends_of
from common.kv_transfer.protocol import (
    FLAG_LOGPROBS,
    FLAG_TOKEN,
    SegmentHeader,
    token_order,
    wire_order,
)
from common.kv_transfer.sender import KVSender
from common.kv_transfer.ticket import Destination, OutgoingSegment, TransferTicket
from engine.kv_blocks import block_index, block_runs, cache_copier, gather_blocks, kv_unit_bytes
from engine.kv_cache_dtype import FP8_E4M3_NAME
from engine.kv_writes import LayerDone
from engine.layers.attention.kv_quant import FP8_KV_DTYPE, quantize_chunk, quantized_name
from engine.scheduler import ScheduledBatch
from engine.tp_layout import kv_head_range
from prefill_node.destinations import WAIT_S, PendingDestination
from prefill_node.first_tokens import FirstTokens

logger = logging.getLogger(__name__)


def layer_spans(
    num_layers: int, layers_per_chunk: int, last_layers: int
) -> list[tuple[int, int, int]]:
    """A step's layers as segments of one request: (layer_start, layer_end,
    layers_per_chunk) each.

    ``last_layers`` = 0: one span, every layer streamed in chunks of
    ``layers_per_chunk``. Otherwise only the last ``last_layers`` layers are;
    the layers before them go as one chunk once the last of them ran, while the
    last layers compute. Why hold them: NVLink stays in its active power state
    for a while after any transfer, and a prefill's GPU is power-capped, so a
    link active over the whole forward costs its matmuls some of their
    throughput (docs/lab/2026-11-27-nvlink-power-and-the-forward.md); held, the
    link wakes for the last layers only, and the held chunk is one large
    message, the wire's fastest size. It pays only if the link sends that chunk
    within the last layers' compute; the gathered chunk is (L - N) / L of the
    step's KV, memory the engine's budget does not count."""
    held = num_layers - last_layers
    if last_layers == 0 or held <= 0 or layers_per_chunk >= num_layers:
        return [(0, num_layers, layers_per_chunk)]
    return [(0, held, held), (held, num_layers, layers_per_chunk)]


@dataclass(slots=True)
class Streamed:
    """A request rank 0 streams: its transfer and how far it went."""

    ticket: TransferTicket  # its destination is set once the decode node's blocks came
    reservation_id: int
    pending: PendingDestination | None  # the decode node's blocks, until they came
    first_block: int = 0  # the decode node holds the blocks before it
    num_blocks: int = 0  # the prompt's blocks in all
    sent_upto: int = 0  # blocks before this went out with an earlier step
    # The first token's logprobs it sends with the token: how many best tokens
    # (-1: none; the request asked for no logprobs).
    logprobs: int = -1


@dataclass(slots=True)
class StepSegment:
    """One request's blocks that a step completes; every rank sends its heads of them."""

    request_id: str
    dest: Destination | None  # None on rank 0 of a GPU until the blocks came (``pending``)
    reservation_id: int
    block_start: int
    block_end: int
    final: bool  # the prompt's last step
    block_ids: list[int]  # this node's blocks [block_start, block_end) of the prompt
    deadline: float  # time.monotonic() (one host's ranks share the clock)
    # Rank 0 on a GPU: the decode node's blocks are still to come; the blocks
    # before its first_block are dropped from the segment once they came
    # (``KVStreamer._resolve``, at the step's first due chunk). Never handed to other ranks.
    pending: PendingDestination | None = None
    # Rank 0: the batch row whose sample is the prompt's first token, sent
    # after the segment's chunks to decode rank 0 (protocol.FLAG_TOKEN), the
    # prompt tokens this node served from its cache, and the token's logprobs
    # (how many best tokens; -1: none); -1: no token goes.
    sample_row: int = -1
    cached_tokens: int = 0
    logprobs: int = -1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> StepSegment:
        return cls(**{**data, "dest": Destination(**data["dest"])})


class KVStreamer:
    """Engine thread only (``open``, ``finish``, ``begin_step`` and its callbacks).

    ``tp_rank`` / ``tp_size``: this rank of the node's engine; ``call_workers``
    (rank 0 of several): hands the plan to the other ranks."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_size: int,
        sender: KVSender,
        layers_per_chunk: int,
        num_kv_heads: int | None = None,
        last_layers: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        call_workers: Callable[[str, dict], None] | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        if layers_per_chunk < 0:
            raise ValueError(f"layers per KV chunk must be >= 0, got {layers_per_chunk}")
        if last_layers < 0:
            raise ValueError(f"layers streamed last must be >= 0, got {last_layers}")
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sender = sender
        self.num_layers = kv_cache.shape[1]
        # The model's KV heads (this rank's cache holds its share of them).
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else kv_cache.shape[4]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.my_heads = kv_head_range(tp_rank, tp_size, self.num_kv_heads)
        self.call_workers = call_workers
        self.unit_bytes = kv_unit_bytes(kv_cache)
        # What this cache holds, by its wire name ("": the model's dtype), and the
        # layers' [k_scale, v_scale] to quantize with for a decode node holding FP8.
        self.kv_cache_dtype = quantized_name(kv_cache.dtype)
        self.kv_scales = kv_scales
        # 0: a step's blocks of every layer in one chunk, sent after its last layer.
        self.layers_per_chunk = min(layers_per_chunk or self.num_layers, self.num_layers)
        # Prepare and queue a step's groups before its launch (a CPU), or from
        # inside its forward (a GPU: ``_emit`` says why).
        self.headers_at_once = not kv_cache.is_cuda
        self.spans = layer_spans(self.num_layers, self.layers_per_chunk, last_layers)
        # The first layer whose hook may have a chunk due: the end of the first span's first chunk.
        layer_start, layer_end, per_chunk = self.spans[0]
        self.first_due = min(layer_start + per_chunk, layer_end) - 1
        # Blocks that come after a step's launch are waited for at its first due
        # chunk (a GPU, one rank: destinations.py says why); otherwise before it.
        self.defer_blocks = not self.headers_at_once and call_workers is None
        # On a GPU chunks are gathered on a stream of their own (``_layer_done`` says
        # why), on the copy engines where the blocks allow (engine/copy_engine.py).
        self.gather_stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self.copier = cache_copier(kv_cache)
        self._streams: dict[str, Streamed] = {}  # rank 0
        # Decode node -> the newest channel epoch its blocks named: one step's
        # group for a node is sent on one channel, the newest.
        self._epochs: dict[str, int] = {}
        # The other ranks: rank 0's plan for the next step, and each request's ticket.
        self._next_plan: list[StepSegment] | None = None
        self._tickets: dict[str, TransferTicket] = {}
        self.first_tokens = FirstTokens(sender)  # the step's, sent once sampled

    def _parts(self, decode_tp: int) -> int:
        """The decode ranks this rank sends to (one pair each: pairing.py)."""
        pairs = kv_pairs(self.num_kv_heads, self.tp_size, decode_tp)
        return len(sends_of(pairs, self.tp_rank))

    # ------------------------------------------------------------ rank 0
    def open(
        self,
        request_id: str,
        pending: PendingDestination,
        deadline: float,
        verify: bool,
        logprobs: int = -1,
    ) -> TransferTicket:
        """A Prefill's transfer, bound for where ``pending`` says once the decode
        node's blocks came. ``logprobs``: how many best tokens the first token's
        message carries with its own logprob (-1: none)."""
        parts = self._parts(pending.decode_tp)
        ticket = TransferTicket(request_id, None, deadline, verify, parts)
        self._streams[request_id] = Streamed(
            ticket, pending.reservation_id, pending, logprobs=logprobs
        )
        return ticket

    def finish(
        self, request_id: str, dest: Destination | None, reservation_id: int, digest: bytes = b""
    ) -> None:
        """A Prefill is done, whatever became of it: nothing more of it goes out but its
        end headers, behind all it queued, from every rank (none for ``dest`` None: a
        Prefill whose blocks never came or did not fit: the board ends that stream).
        ``digest``: the chunks' chained checksum (--verify-kv). Called exactly once per Prefill."""
        streamed = self._streams.pop(request_id, None)
        if streamed is not None:
            streamed.ticket.cancel()  # a no-op once settled
        if dest is None:
            return
        self.end(dest, reservation_id, digest)
        if self.call_workers is not None:
            self.call_workers(
                "kv_finish",
                {
                    "request_id": request_id,
                    "dest": dataclasses.asdict(dest),
                    "reservation_id": reservation_id,
                },
            )

    def end(self, dest: Destination, reservation_id: int, digest: bytes = b"") -> None:
        pairs = kv_pairs(self.num_kv_heads, self.tp_size, dest.tensor_parallel_size)
        for pair in sends_of(pairs, self.tp_rank):
            heads = (pair.head_start, pair.head_end)
            self.sender.end(dest, reservation_id, pair.receiver, heads, digest)

    # ------------------------------------------------------ other ranks
    def follow_step(self, segments: list[StepSegment]) -> None:
        """Rank 0's plan for the step that comes next."""
        self._next_plan = segments

    def follow_finish(self, request_id: str, dest: Destination, reservation_id: int) -> None:
        ticket = self._tickets.pop(request_id, None)
        if ticket is not None:
            ticket.cancel()
        self.end(dest, reservation_id)

    def _known_ticket(self, request_id: str) -> TransferTicket | None:
        if self.tp_rank == 0:
            streamed = self._streams.get(request_id)
            return streamed.ticket if streamed is not None else None
        return self._tickets.get(request_id)

    def _ticket_for(self, seg: StepSegment) -> TransferTicket | None:
        """Rank 0's ticket of the segment's request; another rank's, made at its first segment."""
        ticket = self._known_ticket(seg.request_id)
        if ticket is None and self.tp_rank != 0:
            parts = self._parts(seg.dest.tensor_parallel_size)
            ticket = TransferTicket(seg.request_id, seg.dest, seg.deadline, False, parts)
            self._tickets[seg.request_id] = ticket
        return ticket

    # ----------------------------------------------------------- the hook
    def begin_step(self, batch: ScheduledBatch | None) -> LayerDone | None:
        self.first_tokens.clear()
        if batch is None:  # another rank: rank 0 sent the plan before the step
            plan, self._next_plan = self._next_plan, None
        else:
            plan = self._plan(batch)
            if plan and self.call_workers is not None:
                self.call_workers("kv_step", {"segments": [s.to_json() for s in plan]})
        return self._emit(plan) if plan else None

    def _plan(self, batch: ScheduledBatch) -> list[StepSegment]:
        plan = []
        until = time.monotonic() + WAIT_S  # for the blocks still to come, all of them
        for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            streamed = self._streams.get(seq.request_id)
            if streamed is None or not streamed.ticket.alive:
                continue
            pending = streamed.pending
            if pending is not None and (pending.ready or not self.defer_blocks):
                if not self._take_blocks(streamed, until):
                    continue
                pending = None
            if pending is None and not self._current(streamed):
                continue
            end = seq.num_computed_tokens + num_new
            final = end >= seq.num_prompt_tokens
            if final and pending is None and len(seq.block_table) != streamed.num_blocks:
                streamed.ticket.fail(
                    ValueError(
                        f"the decode node reserved {streamed.num_blocks} blocks, the prompt "
                        f"has {len(seq.block_table)}: are both nodes on the same block size?"
                    )
                )
                continue
            stop = len(seq.block_table) if final else end // self.block_size
            start = max(streamed.sent_upto, streamed.first_block)
            if stop <= start:
                continue
            streamed.sent_upto = stop
            plan.append(
                StepSegment(
                    seq.request_id,
                    streamed.ticket.dest,
                    streamed.reservation_id,
                    start,
                    stop,
                    final,
                    list(seq.block_table[start:stop]),
                    streamed.ticket.deadline,
                    pending,
                    row if final else -1,
                    max(0, seq.num_cached_tokens),  # -1: not admitted yet (never here)
                    streamed.logprobs,
                )
            )
        return plan

    def _current(self, streamed: Streamed) -> bool:
        """Whether the request's channel is its decode node's newest (else its
        ticket fails: nothing sent on an older epoch would land)."""
        dest = streamed.ticket.dest
        if dest.epoch == self._epochs.get(dest.node_id):
            return True
        streamed.ticket.fail(
            TransferError(f"the KV channel to {dest.node_id} moved on to a newer epoch")
        )
        return False

    def _take_blocks(self, streamed: Streamed, until: float) -> bool:
        """The decode node's blocks and channel into ``streamed``, waiting for
        them until ``until`` (time.monotonic(): one bound for all of a step's
        waits) if need be; False (its ticket failed) when none come."""
        pending, ticket = streamed.pending, streamed.ticket
        streamed.pending = None
        try:
            wait_s = max(0.0, min(until, ticket.deadline) - time.monotonic())
            dest = pending.wait(wait_s)
        except Exception as e:  # TransferError or ValueError, the Prefill's failure
            ticket.fail(e)
            return False
        refusal = self._wire_refusal(dest)
        if refusal:
            ticket.fail(TransferError(f"decode node {dest.node_id}: {refusal}"))
            return False
        ticket.dest = dest
        streamed.first_block, streamed.num_blocks = pending.first_block, pending.num_blocks
        # The decode node's epochs only grow: the newest its blocks named is its channel.
        if dest.epoch > self._epochs.get(dest.node_id, -1):
            self._epochs[dest.node_id] = dest.epoch
        return True

    def _wire_refusal(self, dest: Destination) -> str:
        """Why this node cannot send KV in ``dest``'s cache dtype ("" if it can:
        the same, or FP8 quantized on the way: engine/kv_cache_dtype.py's
        pairing rule)."""
        if dest.kv_cache_dtype == self.kv_cache_dtype:
            return ""
        if dest.kv_cache_dtype == FP8_E4M3_NAME:
            if self.kv_scales is None:
                return "it holds FP8 KV and this prefill node has no KV scales to quantize with"
            return ""
        if not dest.kv_cache_dtype:
            return (
                f"its KV cache holds the model's dtype and this prefill node's "
                f"{self.kv_cache_dtype}: FP8 KV cannot feed it (routers never pair them: "
                "docs/architecture.md)"
            )
        return f"its KV cache holds {dest.kv_cache_dtype!r}, which this prefill node cannot send"

    def _quantizes(self, dest: Destination) -> bool:
        """Whether chunks to ``dest`` are quantized on the way (its cache is FP8, ours not)."""
        return dest.kv_cache_dtype != self.kv_cache_dtype

    def _resolve(self, plan: list[StepSegment]) -> list[StepSegment]:
        """The step's segments with the decode node's blocks in (waiting for
        those still to come), less those that failed or hold none of its blocks."""
        resolved = []
        until = time.monotonic() + WAIT_S
        for seg in plan:
            if seg.pending is not None:
                streamed = self._streams.get(seg.request_id)
                if streamed is None or not streamed.ticket.alive:
                    continue
                if streamed.pending is not None and not self._take_blocks(streamed, until):
                    continue
                if not self._current(streamed):
                    continue
                start = max(seg.block_start, streamed.first_block)
                if start >= seg.block_end:
                    continue
                cut = start - seg.block_start
                seg = dataclasses.replace(
                    seg,
                    dest=streamed.ticket.dest,
                    block_start=start,
                    block_ids=seg.block_ids[cut:],
                    pending=None,
                )
            resolved.append(seg)
        return resolved

    def _emit(self, plan: list[StepSegment]) -> LayerDone:
        """The hook that prepares this rank's groups for the step's segments,
        queues them on the sender and then their chunks as the layers finish.

        On a CPU (gloo; torch lets go of the GIL while a layer computes) the
        groups are prepared and queued now, before the step is launched, so
        that the receiver is ready before the first chunk.

        On a GPU nothing of it runs before the launch: preparing a group (a
        block index copied to the device, the headers, the sender's link) took
        host time while the device sat idle before the first layer
        (docs/lab/2026-11-27-prefill-node-step-vs-local.md).
        At the first layer's hook the host is ahead of the device by that
        layer, so the groups are prepared then; a failure fails the step's
        transfers, not the step. They are queued with the step's first chunk,
        at the hook of the layer that completes it: the link carries nothing
        of the step before then, and the receiver posts that chunk's receive
        once it has read the headers (the send waits for it within the layers
        left). With every layer streamed that is layer 0's hook."""
        if self.headers_at_once:
            groups, due = self._prepare(plan)
            self._post(groups)
            return lambda layer: self._layer_done(layer, due.pop(layer, ()))
        pending: list | None = None  # the groups, prepared at the first hook
        due: dict[int, list] = {}
        first_due = 0

        def layer_done(layer: int) -> None:
            nonlocal pending, due, first_due
            if pending is None:
                if layer < self.first_due and any(s.pending and not s.pending.ready for s in plan):
                    return  # nothing is due before then: the blocks may come meanwhile
                pending, due = self._prepare_or_fail(self._resolve(plan))
                first_due = min(due, default=0)
            if pending and layer >= first_due:
                self._post(pending)
                pending = []
            self._layer_done(layer, due.pop(layer, ()))

        return layer_done

    def _prepare_or_fail(self, plan: list[StepSegment]) -> tuple[list, dict[int, list]]:
        """``_prepare`` inside the forward: a failure fails the step's transfers, not the step."""
        try:
            return self._prepare(plan)
        except Exception as e:  # any failure is the transfers', reported on their tickets
            logger.exception("preparing a step's KV groups failed; its transfers fail")
            error = TransferError(f"preparing the step's KV groups failed: {e}")
            self.first_tokens.clear()  # announced by no header that went out
            for seg in plan:
                # The tickets there are; none is made here (making one may be what failed).
                ticket = self._known_ticket(seg.request_id)
                if ticket is not None:
                    ticket.fail(error)
            return [], {}

    def _prepare(self, plan: list[StepSegment]) -> tuple[list, dict[int, list]]:
        """The step's groups, prepared on the sender but not queued, and layer ->
        the chunks whose last layer it is, in wire order."""
        # Per pair channel, a list of members per layer span: every request's
        # first span goes before any request's second, so that the wire order
        # (chunk c of every segment, then c + 1) follows the layers.
        members_of: dict[tuple[Destination, int], list[list]] = {}
        for seg in plan:
            ticket = self._ticket_for(seg)
            if ticket is None or not ticket.alive:
                continue
            pairs = kv_pairs(self.num_kv_heads, self.tp_size, seg.dest.tensor_parallel_size)
            # The runs matter only to the copy engines (none on a CPU).
            runs = block_runs(seg.block_ids) if self.copier is not None else None
            idx = (block_index(seg.block_ids, self.kv_cache.device), runs)
            for pair in sends_of(pairs, self.tp_rank):
                per_span = members_of.setdefault(
                    (seg.dest, pair.receiver), [[] for _ in self.spans]
                )
                for span, layers in enumerate(self.spans):
                    segment = OutgoingSegment(self._header(seg, pair, layers), ticket, seg.final)
                    per_span[span].append((segment, idx, seg.sample_row, seg.logprobs))
        groups = []
        due: dict[int, list] = defaultdict(list)
        for (dest, receiver), per_span in members_of.items():
            members = [m for span in per_span for m in span]
            group = self.sender.prepare_group(dest, [m[0] for m in members], receiver)
            groups.append(group)
            headers = [m[0].header for m in members]
            for i, desc in wire_order(headers):
                segment, idx, _, _ = members[i]
                last = segment.final and desc.layer_end == self.num_layers
                due[desc.layer_end - 1].append((group, segment, desc, idx, last))
            for i in token_order(headers):
                segment, _, row, logprobs = members[i]
                self.first_tokens.add(group, segment, row, logprobs)
        return groups, due

    def _header(self, seg: StepSegment, pair, layers: tuple[int, int, int]) -> SegmentHeader:
        """The header of ``seg``'s layer span ``layers`` to ``pair``'s decode rank."""
        layer_start, layer_end, per_chunk = layers
        # The first token goes to decode rank 0, from rank 0 (which sampled it;
        # it holds KV head 0 as that decode rank does), after the last layers.
        token = (
            seg.sample_row >= 0
            and layer_end == self.num_layers
            and self.tp_rank == 0
            and pair.receiver == 0
        )
        flags = 0
        if token:
            flags = FLAG_TOKEN | (FLAG_LOGPROBS if seg.logprobs >= 0 else 0)
        return SegmentHeader(
            seg.reservation_id,
            seg.block_start,
            seg.block_end,
            layer_start,
            layer_end,
            per_chunk,
            pair.head_start,
            pair.head_end,
            # In the decode node's cache dtype: one byte an element for FP8.
            self.unit_bytes // self.kv_cache.element_size()
            if self._quantizes(seg.dest)
            else self.unit_bytes,
            flags=flags,
            cached_tokens=seg.cached_tokens if token else 0,
            top_logprobs=max(0, seg.logprobs) if token else 0,
        )

    def _post(self, groups: list) -> None:
        for group in groups:
            self.sender.post_group(group)

    def _layer_done(self, layer: int, chunks) -> None:
        """Gather and queue the chunks whose last layer ``layer`` is.

        On a GPU the gathers run on a stream of their own, after the layer, on
        the copy engines where they can: on the engine's stream the held chunk's
        gather held the next layer back
        (docs/lab/2026-11-28-prefill-before-reservation.md). The engine's stream
        waits for them at the step's last layer, so that no later step's KV
        writes (into blocks freed by an abort, a preemption) touch a block
        before it was read; not later (before the next step): the last chunk's
        send kernel then waited for SMs behind the sampling, and more KV was
        left to send after the last layer
        (docs/lab/2026-11-28-held-chunk-copy-engines.md)."""
        gather = self.gather_stream
        if chunks:
            now = time.monotonic()
            base = self.my_heads.start  # header heads are global, the cache holds this rank's
            if gather is not None:
                gather.wait_stream(torch.cuda.current_stream(gather.device))
            for group, segment, desc, (idx, runs), last in chunks:
                heads = (desc.head_start - base, desc.head_end - base)
                data = gather_blocks(
                    self.kv_cache, idx, desc.layers, heads, gather, runs, self.copier
                )
                if segment.header.unit_bytes != self.unit_bytes:  # FP8 on the wire
                    data = self._quantize(data, desc.layers, gather)
                ready = None
                if gather is not None:
                    # Timing-enabled: the sender measures its wire time and what
                    # of the transfer was left after the last layer from it.
                    ready = torch.cuda.Event(enable_timing=True)
                    ready.record(gather)
                self.sender.send_chunk(group, segment, desc, data, ready, now, last)
        if gather is not None and layer == self.num_layers - 1:
            torch.cuda.current_stream(gather.device).wait_stream(gather)

    def _quantize(self, data: torch.Tensor, layers: tuple[int, int], on) -> torch.Tensor:
        """A gathered chunk in FP8 for a decode node holding FP8 (on the gather
        stream, behind the gather, where there is one)."""
        scales = self.kv_scales[layers[0] : layers[1]]
        # In the current stream's pool, as gather_blocks allocates (engine/kv_blocks.py).
        out = torch.empty(data.shape, dtype=FP8_KV_DTYPE, device=data.device)
        if on is None:
            quantize_chunk(data, scales, out)
            return out
        out.record_stream(on)
        with torch.cuda.stream(on):
            quantize_chunk(data, scales, out)
        return out

    def step_sampled(self, samples, rows: list[int]) -> None:
        self.first_tokens.send(samples, rows)
