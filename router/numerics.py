"""The numerics classes of the nodes serving the model, and a prompt's block
hashes in each (docs/architecture.md, "Block hashes").

A node's engine keys its block hashes with its numerics (weight quantization,
KV cache dtype): an FP8 node publishes other digests than a bf16 node for the
same prompt. The router hashes a prompt once per numerics class among the
live nodes, each class's keys derived from the nodes' registrations by the
engine's own mapping (common/cluster/numerics.py), and looks each node's hit
up with its own class's hashes. A cluster usually runs one class: one hash
pass, and the routing read searches that list for every node.

Every routing read updates the classes (router/routing.py), as it does the
nodes' context length (router/limits.py); until the first one, the router
hashes as an engine without quantization and with a cache in the model's
dtype would. A class that appears between a prompt's hashing and its read
finds no hit for that request only: hashes are hints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from common.cluster.numerics import node_numerics_keys, node_numerics_tag
from common.cluster.state import NodeInfo, NumericsHashes
from engine.block_hash import ExtraKeys

# The numerics keys of an unquantized engine with a cache in the model's dtype.
PLAIN: ExtraKeys = ()


class ServedNumerics:
    """The numerics classes of the live nodes serving one model, as last read."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        # Most nodes' class first: its hashes serve every node in the read.
        self.classes: tuple[ExtraKeys, ...] = (PLAIN,)
        # Numerics tag -> class, of the live nodes (common/cluster/numerics.py).
        self.tags: dict[str, ExtraKeys] = {}

    def observe(self, nodes: Iterable[NodeInfo]) -> None:
        """Learn the classes from a read of the live nodes (no node: kept as they are)."""
        tags: dict[str, ExtraKeys] = {}
        counts: Counter[ExtraKeys] = Counter()
        for node in nodes:
            if node.model_id != self.model_id:
                continue
            keys = node_numerics_keys(node)
            tags[node_numerics_tag(node)] = keys
            counts[keys] += 1
        if counts:
            self.tags = tags
            self.classes = tuple(sorted(counts, key=lambda k: (-counts[k], k)))


@dataclass(slots=True, frozen=True)
class PromptHashes:
    """A prompt's full-block hashes in each numerics class (one entry in a
    homogeneous cluster); the first is the class most nodes run."""

    by_numerics: dict[ExtraKeys, list[bytes]]

    @property
    def primary(self) -> list[bytes]:
        """The hashes of the class most nodes run (what pdctl explain lists)."""
        return next(iter(self.by_numerics.values()))

    def route_args(self, tags: dict[str, ExtraKeys]) -> tuple[list[bytes], NumericsHashes]:
        """Cluster.view's arguments: the primary hashes for every node, and
        (tag, hashes) for the nodes whose class is another one hashed here."""
        primary = next(iter(self.by_numerics))
        others = [
            (tag, self.by_numerics[keys])
            for tag, keys in tags.items()
            if keys != primary and keys in self.by_numerics
        ]
        return self.primary, others


NO_HASHES = PromptHashes({PLAIN: []})
