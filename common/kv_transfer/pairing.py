"""Which rank of a prefill node sends which KV heads to which rank of a decode node.

A node with tensor-parallel size t holds each layer's KV heads split over its
ranks (engine/tp_layout.py): rank r holds a contiguous ``kv/t`` of them, or,
when the model has fewer KV heads than ranks, one head replicated on ``t/kv``
ranks. A prefill node of size a and a decode node of size b may differ. Every
receiving rank j needs exactly its own heads; each comes from one sending rank
that holds it, straight into j's reserved blocks (no rank gathers the whole
KV). Where several sending ranks hold a head (replication), receiving rank j
takes it from holder ``j mod (number of holders)``, so the work spreads over
them. Consecutive heads that come from the same sender form one pair, one
pair channel and one segment per step. Torch-free arithmetic, the same on
both nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.tp_layout import MAX_TENSOR_PARALLEL_SIZE, kv_head_range


@dataclass(slots=True, frozen=True)
class KVPair:
    sender: int  # the prefill node's rank
    receiver: int  # the decode node's rank
    head_start: int  # global KV heads [head_start, head_end)
    head_end: int


def check_sizes(num_kv_heads: int, *sizes: int) -> None:
    for size in sizes:
        if not 1 <= size <= MAX_TENSOR_PARALLEL_SIZE or (
            num_kv_heads % size and size % num_kv_heads
        ):
            raise ValueError(
                f"a tensor-parallel size of {size} cannot hold a model with {num_kv_heads} "
                "KV heads (one must divide the other, and it must be 1.."
                f"{MAX_TENSOR_PARALLEL_SIZE})"
            )


def kv_pairs(num_kv_heads: int, senders: int, receivers: int) -> list[KVPair]:
    """Every (sending rank, receiving rank, head range), by receiver then head."""
    check_sizes(num_kv_heads, senders, receivers)
    holders = [
        [i for i in range(senders) if h in kv_head_range(i, senders, num_kv_heads)]
        for h in range(num_kv_heads)
    ]
    pairs: list[KVPair] = []
    for j in range(receivers):
        for h in kv_head_range(j, receivers, num_kv_heads):
            owners = holders[h]
            i = owners[j % len(owners)]
            last = pairs[-1] if pairs else None
            if last is not None and (last.sender, last.receiver, last.head_end) == (i, j, h):
                pairs[-1] = KVPair(i, j, last.head_start, h + 1)
            else:
                pairs.append(KVPair(i, j, h, h + 1))
    return pairs


def sends_of(pairs: list[KVPair], rank: int) -> list[KVPair]:
    return [p for p in pairs if p.sender == rank]


def receives_of(pairs: list[KVPair], rank: int) -> list[KVPair]:
    return [p for p in pairs if p.receiver == rank]
