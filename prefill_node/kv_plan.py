"""What the prefill node's KV streamer (prefill_node/kv_stream.py) plans: a
step's layer spans, each streamed request's progress, and a step's segment of
one request (which rank 0 hands to the other tensor-parallel ranks as JSON)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.kv_transfer.ticket import Destination, TransferTicket
from prefill_node.destinations import PendingDestination


def layer_spans(
    num_layers: int, layers_per_chunk: int, last_layers: int
) -> list[tuple[int, int, int]]:
    """A step's layers as segments of one request: (layer_start, layer_end,
    layers_per_chunk) each.

    ``last_layers`` = 0: one span, every layer streamed in chunks of
    ``layers_per_chunk``. Otherwise only the last ``last_layers`` layers are;
    the layers before them go as one chunk once the last of them ran, while
    the last layers compute. Why hold them: NVLink stays in its active power
    state for some 50-100 ms after any transfer, and a prefill's GPU is
    power-capped, so a link active over the whole forward costs its matmuls
    2.0-2.4% of their throughput (docs/performance.md, "NVLink's power and the
    forward"); held, the link wakes for the last layers only, and the held
    chunk is one large message, the wire's fastest size. It pays only if the
    link sends that chunk within the last layers' compute; the gathered chunk
    is (L - N) / L of the step's KV, memory the engine's budget does not count."""
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
