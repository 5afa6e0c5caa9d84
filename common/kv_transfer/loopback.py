"""In-process KV streaming between two engines: unit tests only.

Integration tests and production use real gloo / NCCL channels between
processes (sender.py, receiver.py). Here ``LoopbackSender`` stands in for the
KVSender that a prefill node's streamer (prefill_node/kv_stream.py) queues on:
it hands every group and chunk at once, in wire order, to a sink, and
``LoopbackLanding`` is a sink that scatters them into another engine's
reserved blocks (checking coverage as a decode node does), so engine-level
tests of the layer-wise hand-off stay fast and single-process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.kv_transfer.checksum import checksum
from common.kv_transfer.coverage import Coverage
from common.kv_transfer.protocol import ChunkDesc, FirstToken, SegmentHeader, parse_first_token
from common.kv_transfer.receiver import KVSink
from common.kv_transfer.ticket import Destination, OutgoingSegment, number_group
from engine.kv_blocks import block_index, kv_unit_bytes

PEER = "loopback"


@dataclass(slots=True)
class _Group:
    segments: list[OutgoingSegment]
    contexts: list[object]
    receiver_rank: int = 0


class LoopbackSender:
    timeout_s = 30.0

    def __init__(self, sink: KVSink) -> None:
        self.sink = sink
        self.groups: list[_Group] = []  # every group prepared, in order

    def prepare_group(
        self, dest: Destination, segments: list[OutgoingSegment], receiver_rank: int = 0
    ) -> _Group:
        number_group(segments)
        group = _Group(segments, [], receiver_rank)
        self.groups.append(group)
        return group

    def post_group(self, group: _Group) -> None:
        group.contexts = self.sink.on_group(PEER, [s.header for s in group.segments])

    def send_chunk(
        self,
        group: _Group,
        segment: OutgoingSegment,
        desc: ChunkDesc | None,
        data: torch.Tensor,
        ready,
        ready_at: float,
        last: bool,
    ) -> None:
        ticket = segment.ticket
        context = group.contexts[group.segments.index(segment)]
        if desc is None:  # a first token (protocol.FLAG_TOKEN)
            token = parse_first_token(segment.header, data.cpu().numpy().tobytes())
            self.sink.on_first_token(PEER, context, token)
            return
        self.sink.on_chunk(PEER, context, desc, data.view(-1).view(torch.uint8), None)
        if ticket is not None:
            if ticket.verify:
                ticket.digests.append(checksum(data))
            ticket.sent(data.numel() * data.element_size(), 0.0, last, 0.0)

    def end(
        self,
        dest: Destination,
        reservation_id: int,
        receiver_rank: int = 0,
        heads: tuple[int, int] = (0, 0),
        digest: bytes = b"",
    ) -> None:
        self.sink.on_group(PEER, [SegmentHeader.end(reservation_id, heads, digest)])


@dataclass(slots=True)
class _Reservation:
    block_ids: list[int]
    coverage: Coverage
    ended: bool = False


@dataclass(slots=True)
class LoopbackLanding:
    """Scatters streamed chunks into ``runner``'s reserved blocks (reservation id -> blocks)."""

    runner: object
    reservations: dict[int, _Reservation] = field(default_factory=dict)
    chunks: list[tuple[int, ChunkDesc]] = field(default_factory=list)  # what landed, in order
    digests: dict[int, list[bytes]] = field(default_factory=dict)
    # Reservation id -> its first token (with the prefill node's cached prompt tokens).
    first_tokens: dict[int, FirstToken] = field(default_factory=dict)
    received_bytes: int = 0  # of KV, as a decode node counts them (DecodeStats)

    def expect(self, reservation_id: int, block_ids: list[int], first_block: int) -> None:
        kv = self.runner.kv_cache
        coverage = Coverage(
            first_block, len(block_ids), kv.shape[1], (0, kv.shape[4]), kv_unit_bytes(kv)
        )
        self.reservations[reservation_id] = _Reservation(block_ids, coverage)
        self.digests[reservation_id] = []

    def landed(self, reservation_id: int) -> bool:
        return self.reservations[reservation_id].coverage.units_left == 0

    def ended(self, reservation_id: int) -> bool:
        return self.reservations[reservation_id].ended

    def on_group(self, peer: str, headers: list[SegmentHeader]) -> list[object]:
        contexts: list[object] = []
        for h in headers:
            res = self.reservations[h.reservation_id]
            if h.is_end:
                res.ended = True
                contexts.append(None)
                continue
            if (error := res.coverage.accept(h)) is not None:
                raise ValueError(error)
            blocks = res.block_ids[h.block_start : h.block_end]
            index = block_index(blocks, self.runner.device)
            contexts.append((h.reservation_id, index, h.cached_tokens))
        return contexts

    def on_chunk(self, peer: str, context, desc: ChunkDesc, data: torch.Tensor, stream) -> None:
        reservation_id, index, _ = context
        self.received_bytes += data.numel() * data.element_size()
        self.runner.scatter_kv(index, data, desc.layers, desc.heads)
        landed = self.runner.gather_kv(index, desc.layers, desc.heads)
        self.digests[reservation_id].append(checksum(landed))
        self.reservations[reservation_id].coverage.land(desc)
        self.chunks.append((reservation_id, desc))

    def on_first_token(self, peer: str, context, token: FirstToken) -> None:
        reservation_id, _, _ = context
        if self.reservations[reservation_id].coverage.units_left:
            raise ValueError(f"a first token before reservation {reservation_id}'s KV")
        self.first_tokens[reservation_id] = token

    def on_peer_failed(self, peer: str, error: Exception, epoch: int) -> None:
        raise error
