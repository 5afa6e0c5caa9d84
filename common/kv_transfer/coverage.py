"""What of a reservation has landed: per (layer, KV head), the blocks so far. Torch-free.

A decode node accepts a segment only if it fits the reservation (its blocks,
the node's layers and heads, the same KV layout) and continues, for every
layer and head it names, exactly where the blocks landed so far end: segments
may split a reservation by blocks (prefill chunks), by layers and by heads (a
tensor-parallel sender's ranks), in any mix, but never overlap or leave a gap.
The reservation is complete when every unit (block x layer x head) landed.
"""

from __future__ import annotations

from common.kv_transfer.protocol import ChunkDesc, SegmentHeader


class Coverage:
    def __init__(
        self,
        first_block: int,
        num_blocks: int,
        num_layers: int,
        heads: tuple[int, int],
        unit_bytes: int,
    ) -> None:
        self.first_block = first_block
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.heads = heads
        self.unit_bytes = unit_bytes
        num_heads = heads[1] - heads[0]
        # Announced (accepted) so far, per layer and head: blocks [first_block, next).
        self._next = [[first_block] * num_heads for _ in range(num_layers)]
        self.units_left = (num_blocks - first_block) * num_layers * num_heads

    def accept(self, h: SegmentHeader) -> str | None:
        """Take an announced segment; None, or why it does not fit (nothing changed)."""
        if h.unit_bytes != self.unit_bytes:
            return (
                f"the KV layouts differ ({h.unit_bytes} bytes per block, layer and head sent, "
                f"{self.unit_bytes} here): are both nodes on the same model, dtype and block size?"
            )
        if not self.first_block <= h.block_start < h.block_end <= self.num_blocks:
            return (
                f"blocks {h.block_start}..{h.block_end} are outside the reservation's "
                f"{self.first_block}..{self.num_blocks}"
            )
        if h.layer_end > self.num_layers:
            return f"layers up to {h.layer_end} sent, this model has {self.num_layers}"
        h0, h1 = self.heads
        if not h0 <= h.head_start < h.head_end <= h1:
            return f"KV heads {h.head_start}..{h.head_end} sent, this node holds {h0}..{h1}"
        heads = range(h.head_start - h0, h.head_end - h0)
        for layer in range(h.layer_start, h.layer_end):
            row = self._next[layer]
            for k in heads:
                if row[k] != h.block_start:
                    return (
                        f"blocks {h.block_start}..{h.block_end} of layer {layer}, head {k + h0} "
                        f"do not continue what came before (blocks up to {row[k]})"
                    )
        for layer in range(h.layer_start, h.layer_end):
            row = self._next[layer]
            for k in heads:
                row[k] = h.block_end
        return None

    def announced_all(self, heads: tuple[int, int]) -> bool:
        """Whether every block of every layer of these KV heads was announced
        (an end header's sender is done: what it announced has landed)."""
        h0 = self.heads[0]
        return all(
            row[k - h0] == self.num_blocks
            for row in self._next
            for k in range(max(heads[0], h0), min(heads[1], self.heads[1]))
        )

    def land(self, desc: ChunkDesc) -> bool:
        """A chunk of an accepted segment landed; True once everything has."""
        self.units_left -= desc.units
        return self.units_left == 0
