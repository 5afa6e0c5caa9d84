"""Where a request goes: a pure function of the cluster's state (no I/O, no clock).

Prefill node: the one holding the longest cached prefix of the request (its
published block hashes), ties broken by the fewest queued prefill tokens, then
at random. Decode node: the one with the most free KV blocks, ties at random.
Nodes that are draining, or that serve another model or block size, are never
chosen. No prefill node (or a request that must be prefilled where it is
decoded) means the decode node prefills itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from common.cluster import NodeInfo, NodeRole, RouteCandidate


class NoRoute(RuntimeError):
    """No node can take this request; the message says why."""


@dataclass(slots=True)
class RouteDecision:
    decode: NodeInfo
    prefill: NodeInfo | None
    prefill_hit_blocks: int
    decode_hit_blocks: int


def choose_route(
    candidates: list[RouteCandidate],
    model_id: str,
    block_size: int,
    remote_prefill: bool = True,
    rng: random.Random | None = None,
) -> RouteDecision:
    rng = rng or random
    usable = [
        c
        for c in candidates
        if not c.node.draining and c.node.model_id == model_id and c.node.block_size == block_size
    ]
    decodes = [c for c in usable if c.node.role is NodeRole.DECODE]
    if not decodes:
        live = [c for c in candidates if c.node.role is NodeRole.DECODE]
        if not live:
            raise NoRoute("no decode node is registered")
        if all(c.node.draining for c in live):
            raise NoRoute("every decode node is draining")
        raise NoRoute(f"no decode node serves model {model_id!r} with block size {block_size}")
    decode = max(decodes, key=lambda c: (c.node.kv_blocks_free, rng.random()))
    prefill = None
    if remote_prefill:
        prefills = [c for c in usable if c.node.role is NodeRole.PREFILL]
        if prefills:
            prefill = max(
                prefills,
                key=lambda c: (c.hit_blocks, -c.node.queued_prefill_tokens, rng.random()),
            )
    return RouteDecision(
        decode=decode.node,
        prefill=prefill.node if prefill else None,
        prefill_hit_blocks=prefill.hit_blocks if prefill else 0,
        decode_hit_blocks=decode.hit_blocks,
    )
