"""The prefill node's KV streaming: an engine KV-write observer (engine/kv_writes.py).

For every step that computes tokens of a request being streamed, ``begin_step``
(engine thread, before the forward) decides which of its blocks the step
completes -- full blocks up to the step's last token, and on the prompt's last
step every block that is left -- skipping those the decode node already holds
(its own prefix cache: blocks before ``first_block``) and those sent by an
earlier step. They form one segment (protocol.py) per request; a step's
segments for one decode node form a group, whose headers are queued on the
sender at once, before layer 0 runs. Then, as each group of
``layers_per_chunk`` layers is done (``layer_done``), their KV of those blocks
is gathered into a fresh buffer -- on the engine's stream, right behind the
layers, so the blocks may be reused by any later step -- and queued as one
chunk; the sender's thread (its own stream) puts it on the wire while the next
layers compute. After the prompt's last layer only its last chunk is left.

Chunked prefill: a long prompt streams chunk by chunk; a block cut by a chunk
boundary goes with the chunk that fills it. Prefix hits on this node need no
case of their own: those blocks hold their KV already and go with the first
segment.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from common.kv_transfer.channel import TransferError
from common.kv_transfer.protocol import SegmentHeader, wire_order
from common.kv_transfer.sender import Destination, KVSender, OutgoingSegment, TransferTicket
from engine.kv_blocks import block_index, gather_blocks, kv_unit_bytes
from engine.kv_writes import LayerDone
from engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class _Streamed:
    ticket: TransferTicket
    reservation_id: int
    first_block: int  # the decode node holds the blocks before it
    num_blocks: int  # the prompt's blocks in all
    sent_upto: int  # blocks before this went out with an earlier step


class KVStreamer:
    """Engine thread only (``open``, ``close``, ``begin_step`` and its callbacks)."""

    def __init__(
        self, kv_cache: torch.Tensor, block_size: int, sender: KVSender, layers_per_chunk: int
    ) -> None:
        if layers_per_chunk < 0:
            raise ValueError(f"layers per KV chunk must be >= 0, got {layers_per_chunk}")
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sender = sender
        self.num_layers = kv_cache.shape[1]
        self.num_heads = kv_cache.shape[4]
        self.unit_bytes = kv_unit_bytes(kv_cache)
        # 0: a step's blocks of every layer in one chunk, sent after its last layer.
        self.layers_per_chunk = min(layers_per_chunk or self.num_layers, self.num_layers)
        self._streams: dict[str, _Streamed] = {}
        # Decode node -> the channel epoch its latest Prefill named: one step's
        # group for a node is sent on one channel, the newest.
        self._epochs: dict[str, int] = {}

    def open(
        self,
        request_id: str,
        dest: Destination,
        reservation_id: int,
        first_block: int,
        num_blocks: int,
        deadline: float,
        verify: bool,
    ) -> TransferTicket:
        ticket = TransferTicket(request_id, dest, deadline, verify)
        self._epochs[dest.node_id] = dest.epoch
        self._streams[request_id] = _Streamed(
            ticket, reservation_id, first_block, num_blocks, first_block
        )
        return ticket

    def finish(self, request_id: str, dest: Destination, reservation_id: int) -> None:
        """A Prefill is done, whatever became of it (sent, failed, aborted, refused):
        nothing more of it goes out but its end header, which follows everything
        queued for it. Called exactly once per Prefill."""
        streamed = self._streams.pop(request_id, None)
        if streamed is not None:
            streamed.ticket.cancel()  # a no-op once settled
        self.sender.end(dest, reservation_id)

    # ----------------------------------------------------------- the hook
    def begin_step(self, batch: ScheduledBatch) -> LayerDone | None:
        groups: dict[Destination, list[tuple[OutgoingSegment, torch.Tensor]]] = defaultdict(list)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            streamed = self._streams.get(seq.request_id)
            if streamed is None or not streamed.ticket.alive:
                continue
            dest = streamed.ticket.dest
            if dest.epoch != self._epochs.get(dest.node_id):
                streamed.ticket.fail(
                    TransferError(f"the KV channel to {dest.node_id} moved on to a newer epoch")
                )
                continue
            end = seq.num_computed_tokens + num_new
            final = end >= seq.num_prompt_tokens
            if final and len(seq.block_table) != streamed.num_blocks:
                streamed.ticket.fail(
                    ValueError(
                        f"the decode node reserved {streamed.num_blocks} blocks, the prompt "
                        f"has {len(seq.block_table)}: are both nodes on the same block size?"
                    )
                )
                continue
            stop = streamed.num_blocks if final else end // self.block_size
            start = streamed.sent_upto
            if stop <= start:
                continue
            streamed.sent_upto = stop
            header = SegmentHeader(
                streamed.reservation_id,
                start,
                stop,
                0,
                self.num_layers,
                self.layers_per_chunk,
                0,
                self.num_heads,
                self.unit_bytes,
            )
            idx = block_index(seq.block_table[start:stop], self.kv_cache.device)
            segment = OutgoingSegment(header, streamed.ticket, final)
            groups[dest].append((segment, idx))
        if not groups:
            return None
        # layer -> the chunks whose last layer it is, in wire order.
        due: dict[int, list] = defaultdict(list)
        for dest, members in groups.items():
            group = self.sender.open_group(dest, [s for s, _ in members])
            headers = [s.header for s, _ in members]
            for i, desc in wire_order(headers):
                segment, idx = members[i]
                last = segment.final and desc.layer_end == headers[i].layer_end
                due[desc.layer_end - 1].append((group, segment, desc, idx, last))
        return lambda layer: self._layer_done(due.pop(layer, ()))

    def _layer_done(self, chunks) -> None:
        if not chunks:
            return
        now = time.monotonic()
        cuda = self.kv_cache.is_cuda
        for group, segment, desc, idx, last in chunks:
            data = gather_blocks(self.kv_cache, idx, desc.layers, desc.heads)
            ready = None
            if cuda:
                # Timing-enabled: the sender measures its wire time and what of
                # the transfer was left after the last layer from it.
                ready = torch.cuda.Event(enable_timing=True)
                ready.record()
            self.sender.send_chunk(group, segment, desc, data, ready, now, last)
