"""Where a request goes: a pure function of the cluster's state (no I/O, no clock).

Inputs: every live node as the routing read saw it (its last heartbeat, the
leading blocks of this prompt its device pool caches and how many more its
host tier holds after those, whether an operator drained it), this
router's own view of what it has sent each node (``LocalLoad``, which guards
against stale or false reports), and the request's size.

Cost policy (``RoutingPolicy.COST``, the default):

1. Nodes that are drained, shutting down, silent for longer than
   ``stale_heartbeat_s``, recently failed by this router, or that serve
   another model or block size are excluded (the explanation says why), and
   so are prefill nodes whose KV cannot feed the chosen decode node's cache
   (an FP8 cache never feeds one in the model's dtype: engine/kv_cache_dtype.py).
2. Decode node: the lowest

       load_weight * slots in use / slots
     + kv_weight   * KV blocks in use after admitting this prompt / KV blocks
     + full_penalty  (when it lacks the free blocks for this prompt)
     - hit_weight  * (device-hit fraction
                      + (1 - host_copy_cost) * host-hit fraction of the prompt)
     + hit_weight  * min(1, lora_load_tokens / prompt tokens)
                     (a LoRA request, its adapter in none of the node's device slots)

   where "in use" is the larger of what the node reported plus what this
   router sent it since, and what this router alone has in flight there.
   A host-tier hit still needs device blocks (its KV is copied into them), so
   only device hits lower the blocks needed.
3. Conditional disaggregation: the decode node prefills the prompt itself
   (no KV moves) when the part it does not cache is at most
   ``local_prefill_max_tokens``, or it caches at least ``local_prefill_min_hit``
   of the prompt, or no prefill node is usable (host-tier hits count as
   cached here: its own prefill copies them in).
4. Otherwise the prefill node with the lowest

       prompt tokens in neither of its tiers
     + host_copy_cost * prompt tokens in its host tier
     + queue_weight   * prefill tokens queued there
     + lora_load_tokens   (a LoRA request, its adapter in no device slot there)

   (an estimate, in tokens, of the time to the first token: a host-tier hit
   costs a copy-in, priced as a fraction of computing the token).

A node that holds a request's LoRA adapter but not in a device slot
(NodeInfo.lora_resident) must copy its weights in before the request's first
step there, and read them from disk when its host cache dropped them; until
then the request waits. ``lora_load_tokens`` prices that wait as the prompt
tokens the node could have computed meanwhile, so that among otherwise equal
nodes the one with the adapter in place wins, while a node much less loaded
or caching much more of the prompt still wins over it.

Ties are broken at random. ``ROUND_ROBIN`` and ``RANDOM`` ignore caches and
load (baselines for benchmarks/routing.py); they still skip excluded nodes and
always prefill remotely when they can.
"""

from __future__ import annotations

import enum
import operator
import random
from dataclasses import dataclass, field

from common.cluster.numerics import node_pairing_refusal
from common.cluster.state import (
    ClusterView,
    NodeInfo,
    NodeRole,
    RouteCandidate,
    lora_resident_of,
)
from router.models import BASE_MODEL, ModelChoice, holds_adapter


class NoRoute(RuntimeError):
    """No node can take this request; the message says why."""


class RoutingPolicy(enum.Enum):
    COST = "cost"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


@dataclass(slots=True)
class RoutingConfig:
    """The policy's knobs; `pdserve router --help` lists them as flags."""

    policy: RoutingPolicy = RoutingPolicy.COST
    # Decode cost: weight of the fraction of sequence slots in use.
    load_weight: float = 1.0
    # Decode cost: weight of the fraction of KV blocks in use after this prompt.
    kv_weight: float = 1.0
    # Decode cost: weight of the fraction of the prompt the node already caches.
    hit_weight: float = 1.0
    # Decode cost added when the node lacks free blocks for the prompt (it would queue).
    full_penalty: float = 10.0
    # Prefill cost: weight of a queued prefill token against an uncached prompt token.
    queue_weight: float = 1.0
    # Cost of copying one prompt token's KV in from a node's host tier, as a
    # fraction of computing it (0: as good as a device hit, 1: as recomputing);
    # the default's basis is in docs/routing.md.
    host_copy_cost: float = 0.1
    # Cost of copying a LoRA adapter into a node's device slot (it holds none
    # of the request's), in prompt tokens computed meanwhile (docs/routing.md).
    lora_load_tokens: float = 64.0
    # Prefill on the decode node when at most this many prompt tokens are uncached there.
    local_prefill_max_tokens: int = 256
    # ... or when the decode node caches at least this fraction of the prompt.
    local_prefill_min_hit: float = 0.8
    # A node whose last heartbeat is older than this is treated as unhealthy.
    stale_heartbeat_s: float = 3.0
    # After a failed call to a node, this router avoids it for this long.
    failure_cooldown_s: float = 5.0
    # Tries per request when a node fails before the first token (each on other nodes).
    max_attempts: int = 3
    # Times a stream whose decode node dies after its first token moves to
    # another one (router/migration.py); 0: it fails instead.
    max_migrations: int = 2
    # Seconds such a stream waits for a decode node to take it when none can
    # now (the only one died and is restarting), before it fails.
    migration_wait_s: float = 15.0
    # Requests this router relays at once; beyond, RESOURCE_EXHAUSTED at once.
    max_in_flight: int = 1024
    # While Redis is unreachable: route on the last-known nodes, probe it this often.
    redis_retry_s: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.policy, str):
            try:
                self.policy = RoutingPolicy(self.policy)
            except ValueError:
                allowed = ", ".join(p.value for p in RoutingPolicy)
                raise ValueError(
                    f"routing policy must be one of {allowed}; got {self.policy!r}"
                ) from None
        for name in (
            "load_weight",
            "kv_weight",
            "hit_weight",
            "full_penalty",
            "queue_weight",
            "lora_load_tokens",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(
                f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}"
            )
        if not 0 <= self.host_copy_cost <= 1:
            raise ValueError(f"host_copy_cost must be in [0, 1], got {self.host_copy_cost}")
        if not 0 <= self.local_prefill_min_hit <= 1:
            raise ValueError(
                f"local_prefill_min_hit must be in [0, 1], got {self.local_prefill_min_hit}"
            )
        for name in ("max_attempts", "max_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if not self.migration_wait_s >= 0:
            raise ValueError(f"migration_wait_s must be >= 0, got {self.migration_wait_s}")
        for name in ("stale_heartbeat_s", "failure_cooldown_s", "redis_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class LocalLoad:
    """What this router has sent one node and not yet seen finish."""

    requests: int = 0  # in flight there
    requests_since_report: int = 0  # of those, sent after the node's last heartbeat
    prefill_tokens: int = 0  # uncached prompt tokens sent there, first token not back yet
    prefill_tokens_since_report: int = 0
    blocks: int = 0  # KV blocks those requests hold there
    blocks_since_report: int = 0
    failed_ago_s: float | None = None  # since this router's last failed call to it


@dataclass(slots=True)
class RouteRequest:
    model_id: str
    block_size: int
    prompt_tokens: int
    # False for requests that must be prefilled where they are decoded (n > 1, prompt logprobs).
    allow_remote_prefill: bool = True
    # Its LoRA adapter (router/models.py): only nodes holding it take the request.
    model: ModelChoice = BASE_MODEL


@dataclass(slots=True)
class NodeScore:
    """One node's line in a routing explanation."""

    node_id: str
    role: NodeRole
    hit_blocks: int  # in its device pool
    cost: float | None = None  # None: excluded
    excluded: str = ""  # why, when excluded
    terms: dict[str, float] = field(default_factory=dict)  # the cost's parts
    host_hit_blocks: int = 0  # after those, in its host tier


@dataclass(slots=True)
class RouteDecision:
    decode: NodeInfo
    prefill: NodeInfo | None  # None: the decode node prefills
    prefill_hit_blocks: int
    decode_hit_blocks: int
    # Where the decode node prefills: whether the prompt was ready in its host tier.
    prefill_host_hit_blocks: int
    decode_host_hit_blocks: int
    # Why the decode node prefills (empty when a prefill node does).
    local_prefill_reason: str
    scores: list[NodeScore]


def exclusion(
    c: RouteCandidate,
    view: ClusterView,
    request: RouteRequest,
    local: LocalLoad | None,
    config: RoutingConfig,
) -> str:
    """Why this node may not take the request ("" if it may)."""
    node = c.node
    if c.drained:
        return "drained by an operator"
    if node.draining:
        return "shutting down"
    if node.model_id != request.model_id:
        return f"serves model {node.model_id!r}"
    if node.block_size != request.block_size:
        return f"block size {node.block_size}"
    if not holds_adapter(node, request.model):
        return f"lacks LoRA adapter {request.model.lora_name!r}"
    age_s = view.age_ms(node) / 1e3
    if age_s > config.stale_heartbeat_s:
        return f"last heartbeat {age_s:.1f} s ago"
    failed_ago_s = local.failed_ago_s if local is not None else None
    if failed_ago_s is not None and failed_ago_s < config.failure_cooldown_s:
        return f"a call to it failed {failed_ago_s:.1f} s ago"
    return ""


def decode_cost(
    c: RouteCandidate, request: RouteRequest, local: LocalLoad, config: RoutingConfig
) -> dict[str, float]:
    node = c.node
    bs = request.block_size
    slots = node.max_num_seqs or 256  # a node that did not say: vLLM's default
    running = max(node.running + node.waiting + local.requests_since_report, local.requests)
    total = max(node.kv_blocks_total, 1)
    used = max(node.kv_blocks_total - node.kv_blocks_free + local.blocks_since_report, local.blocks)
    prompt_blocks = -(-request.prompt_tokens // bs)
    needed = prompt_blocks - c.hit_blocks + 1  # + the first decode block
    prompt = max(request.prompt_tokens, 1)
    hit_fraction = min(1.0, c.hit_blocks * bs / prompt)
    host_fraction = min(1.0 - hit_fraction, c.host_hit_blocks * bs / prompt)
    terms = {
        "load": config.load_weight * running / slots,
        "kv": config.kv_weight * min(1.0, (used + needed) / total),
        "hit": -config.hit_weight * (hit_fraction + (1 - config.host_copy_cost) * host_fraction),
    }
    if used + needed > node.kv_blocks_total:
        terms["full"] = config.full_penalty
    if _loads_adapter(node, request):
        terms["lora_load"] = config.hit_weight * min(1.0, config.lora_load_tokens / prompt)
    return terms


def prefill_cost(
    c: RouteCandidate, request: RouteRequest, local: LocalLoad, config: RoutingConfig
) -> dict[str, float]:
    node = c.node
    device = min(request.prompt_tokens, c.hit_blocks * request.block_size)
    host = min(request.prompt_tokens - device, c.host_hit_blocks * request.block_size)
    queued = max(
        node.queued_prefill_tokens + local.prefill_tokens_since_report, local.prefill_tokens
    )
    terms = {
        "uncached": float(request.prompt_tokens - device - host),
        "queue": config.queue_weight * queued,
    }
    if host:
        terms["host_copy"] = config.host_copy_cost * host
    if _loads_adapter(node, request):
        terms["lora_load"] = config.lora_load_tokens
    return terms


def _loads_adapter(node: NodeInfo, request: RouteRequest) -> bool:
    """Whether the request's adapter must be copied into one of the node's
    device slots first (module docstring)."""
    name = request.model.lora_name
    return bool(name) and name not in lora_resident_of(node)


def choose_route(
    view: ClusterView,
    request: RouteRequest,
    config: RoutingConfig,
    local: dict[str, LocalLoad] | None = None,
    rng: random.Random | None = None,
    turn: int = 0,
) -> RouteDecision:
    """The route for one request, with a score line for every node considered.

    ``turn`` is the caller's request counter (used by ROUND_ROBIN only).
    """
    rng = rng or random.Random()
    local = local or {}
    scores: list[NodeScore] = []
    decodes: list[RouteCandidate] = []
    prefills: list[RouteCandidate] = []
    for c in sorted(view.candidates, key=_node_id):
        why = exclusion(c, view, request, local.get(c.node.node_id), config)
        if why:
            scores.append(_unscored(c, why))
        else:
            # `is`, not a dict keyed by role: an Enum's __hash__ is Python code.
            (decodes if c.node.role is _DECODE else prefills).append(c)
    if not decodes:
        _raise_no_decode(view, scores)
    decode = _pick_decode(decodes, request, config, local, rng, turn, scores)
    prefills = _kv_compatible(prefills, decode.node, scores)
    remote_ok = request.allow_remote_prefill and bool(prefills)
    if config.policy is RoutingPolicy.COST:
        reason = _local_prefill_reason(decode, request, config, remote_ok)
        prefill = None
        if prefills:
            # Scored even when unused, so that an explanation shows every node.
            cheapest, prefill_scores = _cheapest(
                prefills, request, local, config, rng, prefill_cost
            )
            scores.extend(prefill_scores)
            if not reason:
                prefill = cheapest
    else:
        if config.policy is RoutingPolicy.ROUND_ROBIN:
            prefill = prefills[turn % len(prefills)] if remote_ok else None
        else:
            prefill = rng.choice(prefills) if remote_ok else None
        reason = "" if prefill else _no_remote_reason(request)
        scores.extend(_unscored(c) for c in decodes + prefills)
    scores.sort(key=_role_then_id)
    return RouteDecision(
        decode=decode.node,
        prefill=prefill.node if prefill else None,
        prefill_hit_blocks=prefill.hit_blocks if prefill else 0,
        decode_hit_blocks=decode.hit_blocks,
        prefill_host_hit_blocks=prefill.host_hit_blocks if prefill else 0,
        decode_host_hit_blocks=decode.host_hit_blocks,
        local_prefill_reason=reason,
        scores=scores,
    )


# What this router has on a node it sent nothing: the cost functions only read it.
_NOTHING_SENT = LocalLoad()
# The policy runs on every request (docs/performance.md, "Routing"): plain
# attribute reads where Enum's own accessors run Python code.
_DECODE = NodeRole.DECODE
_cost_then_draw = operator.itemgetter(0, 1)


def _pick_decode(decodes, request, config, local, rng, turn, scores) -> RouteCandidate:
    """The decode node by the policy (its scores added under COST)."""
    if config.policy is RoutingPolicy.COST:
        decode, decode_scores = _cheapest(decodes, request, local, config, rng, decode_cost)
        scores.extend(decode_scores)
        return decode
    if config.policy is RoutingPolicy.ROUND_ROBIN:
        return decodes[turn % len(decodes)]
    return rng.choice(decodes)


def _kv_compatible(
    prefills: list[RouteCandidate], decode: NodeInfo, scores: list[NodeScore]
) -> list[RouteCandidate]:
    """The prefill nodes whose KV may feed ``decode``'s cache; the others get a
    score line saying why not (an FP8 prefill node never feeds a bf16 decode node,
    nor a node of other weights any)."""
    kept = []
    for c in prefills:
        why = node_pairing_refusal(c.node, decode)
        if why:
            scores.append(_unscored(c, f"{why} (decode node {decode.node_id})"))
        else:
            kept.append(c)
    return kept


def _unscored(c: RouteCandidate, excluded: str = "") -> NodeScore:
    """A node's line without a cost: excluded, or under a policy that has none."""
    return NodeScore(
        c.node.node_id,
        c.node.role,
        c.hit_blocks,
        excluded=excluded,
        host_hit_blocks=c.host_hit_blocks,
    )


def _node_id(c: RouteCandidate) -> str:
    return c.node.node_id


def _role_then_id(s: NodeScore) -> tuple[str, str]:
    return (s.role._value_, s.node_id)


def _cheapest(candidates, request, local, config, rng, cost_fn):
    scored = []
    for c in candidates:
        terms = cost_fn(c, request, local.get(c.node.node_id) or _NOTHING_SENT, config)
        scored.append((sum(terms.values()), rng.random(), c, terms))
    best = min(scored, key=_cost_then_draw)
    scores = [
        NodeScore(c.node.node_id, c.node.role, c.hit_blocks, cost, "", terms, c.host_hit_blocks)
        for cost, _, c, terms in scored
    ]
    return best[2], scores


def _local_prefill_reason(
    decode: RouteCandidate, request: RouteRequest, config: RoutingConfig, remote_ok: bool
) -> str:
    if not remote_ok:
        return _no_remote_reason(request)
    # Its own prefill copies in what its host tier holds.
    held = decode.hit_blocks + decode.host_hit_blocks
    cached = min(request.prompt_tokens, held * request.block_size)
    uncached = request.prompt_tokens - cached
    if uncached <= config.local_prefill_max_tokens:
        return f"only {uncached} uncached prompt tokens (<= {config.local_prefill_max_tokens})"
    if cached >= config.local_prefill_min_hit * request.prompt_tokens:
        return (
            f"the decode node caches {cached} of {request.prompt_tokens} prompt tokens"
            f" (>= {config.local_prefill_min_hit:.0%})"
        )
    return ""


def _no_remote_reason(request: RouteRequest) -> str:
    if not request.allow_remote_prefill:
        return "the request must be prefilled where it is decoded (n > 1 or prompt logprobs)"
    return "no prefill node is usable"


def _raise_no_decode(view: ClusterView, scores: list[NodeScore]) -> None:
    excluded = [s for s in scores if s.role is NodeRole.DECODE]
    if not excluded:
        raise NoRoute("no decode node is registered")
    reasons = "; ".join(f"{s.node_id}: {s.excluded}" for s in excluded)
    raise NoRoute(f"no decode node can take the request ({reasons})")
