"""Cluster state in Redis: node registry, heartbeats with a TTL, load, block-hash index.

Key schema (docs/architecture.md, "Cluster state"; ``pds`` is the default prefix):

- ``pds:node:{id}``   hash: the fields of ``NodeInfo`` (role, address, transfer
                      endpoint, model id, block size, KV blocks total/free,
                      running, waiting, queued prefill tokens, counters...) and
                      ``seen_ms``, the Redis server's clock at the last
                      heartbeat. Expires ``ttl`` seconds after the last
                      heartbeat, so a dead node vanishes by itself.
- ``pds:nodes``       set of node ids; entries whose hash expired are pruned by
                      the routing script when it meets them.
- ``pds:blocks:{id}`` set of the 16-byte block hashes cached on that node (added
                      on insert, removed on eviction); expires with the node.
- ``pds:host_blocks:{id}`` the same for the node's host tier (``--swap-space``):
                      hashes whose KV a spill copied to host memory (added
                      when the copy lands, removed when the tier evicts it);
                      a hash may be in both sets.
- ``pds:draining``    set of node ids an operator drained (``pdctl drain``);
                      kept across node restarts until undrained.

One heartbeat is one pipelined round trip. One routing decision is one round
trip: a Lua script (common/cluster/route_script.py) returns the server's clock and,
for every live node, its routing fields, how many leading blocks of the
request its device pool holds, and how many more after those its host tier holds.
"""

from __future__ import annotations

import enum
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

from common.cluster.redis_script import ScriptConnection, Sent
from common.cluster.route_script import (
    MAX_ROUTED_BLOCKS,
    PACKED_FIELDS,
    ROUTE_KEY,
    ROUTE_SCRIPT,
    STAMP_SCRIPT,
)
from engine.block_hash import DIGEST_SIZE

# (numerics tag, block hashes) of each numerics class a routing read searches
# beside its default hashes (common/cluster/route_script.py).
NumericsHashes = Sequence[tuple[str, list[bytes]]]
DEFAULT_PREFIX = "pds"
DEFAULT_TTL_S = 5.0


class NodeRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class NodeInfo:
    node_id: str
    role: NodeRole
    address: str
    model_id: str
    block_size: int
    transfer_host: str = ""
    transfer_port: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    # Its host tier (--swap-space): slots in all, and those a spill can take
    # (empty or evictable cached); 0 and 0 without a tier.
    host_kv_blocks_total: int = 0
    host_kv_blocks_free: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    max_num_seqs: int = 0
    tensor_parallel_size: int = 1  # ranks of its engine, one process each
    num_gpus: int = 0  # GPUs it holds (one per rank; 0 on a CPU)
    model_family: str = ""  # engine/models/families.py: "llama", "qwen3_moe", ...
    # The longest prompt + output its engine serves; routers take theirs from
    # it (router/limits.py). 0: a node of a release that does not publish it.
    max_model_len: int = 0
    # Its LoRA adapters, name -> digest of the adapter's files, as a JSON
    # object ("" without any): routers list them (/v1/models), send an
    # adapter's requests only to nodes that have it, and key its block hashes
    # with the digest (lora_adapters_of).
    lora_adapters: str = ""
    # What it computes in and what its KV cache stores ("bfloat16", "fp8_e4m3"...;
    # "": a node that does not say): routers pair prefill and decode nodes by
    # the KV dtypes (common/kv_transfer/kv_dtypes.py), pdctl nodes shows both.
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    # Of those, the names with weights in a device slot now, as a JSON array
    # ("" for none): a request for another one first copies it in (and may
    # read it from disk), which routing prices (router/policy.py).
    lora_resident: str = ""
    draining: bool = False  # the node itself is shutting down (SIGTERM)
    updated_ms: int = 0  # the node's clock at its last heartbeat
    # The node's clock when its process started: a restart under the same id
    # (and address) registers a new value, which tells routers to forget the
    # old process's failures and connections (router/routing.py). 0: unknown.
    started_ms: int = 0
    seen_ms: int = 0  # the Redis server's clock at its last heartbeat
    # Counters since the node started.
    requests_total: int = 0
    preemptions: int = 0
    computed_tokens: int = 0  # through the model: prompts, chunks, decode steps
    generated_tokens: int = 0  # sampled
    kv_transfers: int = 0  # sent (prefill node) or landed (decode node)
    kv_transfer_failures: int = 0
    kv_late_transfers: int = 0  # arrived for a reservation that was gone; dropped
    kv_checksum_mismatches: int = 0
    kv_transfer_bytes: int = 0  # sent (prefill node) or received (decode node)
    kv_transfer_us: int = 0  # time spent sending (prefill node)
    # Requests aborted (client gone, deadline, peer failure, lease) by the stage
    # they were in on this node (common/runtime/reliability.py Stage).
    aborted_queued: int = 0
    aborted_prefill: int = 0
    aborted_transfer: int = 0
    aborted_admission: int = 0
    aborted_decode: int = 0
    deadline_exceeded: int = 0
    leases_expired: int = 0  # decode node: reservations reclaimed unfilled
    rejected: int = 0  # refused for lack of room (RESOURCE_EXHAUSTED)
    kv_gathers_copy_engine: int = 0  # prefill node: KV chunks gathered by the copy engines
    # Decode node with --speculative-config: proposals verified (one per
    # speculating sequence and step), tokens proposed, tokens the target kept.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def to_fields(self) -> dict[str, str]:
        out = {}
        for f in fields(self):
            if f.name == "seen_ms":  # written by the server's clock, not ours
                continue
            value = getattr(self, f.name)
            if isinstance(value, NodeRole):
                value = value.value
            elif isinstance(value, bool):
                value = int(value)
            out[f.name] = str(value)
        out[ROUTE_KEY] = self.route_value()
        return out

    def route_value(self) -> str:
        """The ``route`` hash field: PACKED_FIELDS as a JSON array."""
        values = [getattr(self, name) for name in PACKED_FIELDS]
        values = [v.value if isinstance(v, NodeRole) else v for v in values]
        return json.dumps(
            [int(v) if isinstance(v, bool) else v for v in values], separators=(",", ":")
        )

    @classmethod
    def from_fields(cls, raw: dict[Any, Any]) -> NodeInfo:
        data = {_text(k): _text(v) for k, v in raw.items()}
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name == "role":
                kwargs[f.name] = NodeRole(value)
            elif f.name == "draining":
                kwargs[f.name] = value not in ("0", "", "False")
            elif f.type in ("int", int):
                kwargs[f.name] = int(value)
            else:
                kwargs[f.name] = value
        return cls(**kwargs)

    @classmethod
    def from_route(
        cls, node_id: str, values: list[Any], parsed: dict[str, tuple] | None = None
    ) -> NodeInfo:
        """From what the routing script read: ``[route, seen_ms]``, or every
        ROUTE_FIELDS field from a node of an earlier version; the hot path.

        ``parsed``: node id -> (route bytes, NodeInfo's arguments before
        ``seen_ms``) of the last read, updated here. A node's route changes with
        its heartbeat, twice a second, while routing reads it on every request,
        and decoding the JSON was most of the client's time per node; passing
        the fields by position rather than by name halves what is left
        (docs/lab/2026-11-25-router-own-path.md).
        """
        if len(values) != 2:
            return cls.from_route_values(node_id, values)
        route = values[0]
        last = parsed.get(node_id) if parsed is not None else None
        if last is None or last[0] != route:
            packed = zip(_PACKED_TYPES, json.loads(route), strict=False)
            named = {name: kind(v) for (name, kind), v in packed}
            named["node_id"] = node_id
            last = (route, tuple(named.get(name, default) for name, default in _BEFORE_SEEN))
            if MISSING in last[1]:  # role, address, model id and block size come first
                raise ValueError(f"node {node_id}'s route field lacks a required field")
            if parsed is not None:
                parsed[node_id] = last
        return cls(*last[1], int(values[1] or 0))

    @classmethod
    def from_route_values(cls, node_id: str, values: list[Any]) -> NodeInfo:
        """From the fields of ROUTE_FIELDS, in that order (a node hash without ``route``)."""
        v = [_text(x) if x is not None else "" for x in values]
        return cls(
            node_id=node_id,
            role=NodeRole(v[0]),
            address=v[1],
            model_id=v[2],
            block_size=_int(v[3]),
            transfer_host=v[4],
            transfer_port=_int(v[5]),
            kv_blocks_total=_int(v[6]),
            kv_blocks_free=_int(v[7]),
            running=_int(v[8]),
            waiting=_int(v[9]),
            queued_prefill_tokens=_int(v[10]),
            max_num_seqs=_int(v[11]),
            draining=v[12] not in ("0", "", "False"),
            seen_ms=_int(v[13]),
            tensor_parallel_size=_int(v[14]) or 1,  # a node that predates the field: 1
            max_model_len=_int(v[15]) if len(v) > 15 else 0,
            started_ms=_int(v[16]) if len(v) > 16 else 0,
            lora_adapters=v[17] if len(v) > 17 else "",
            kv_cache_dtype=v[18] if len(v) > 18 else "",
            lora_resident=v[19] if len(v) > 19 else "",
            weight_dtype=v[20] if len(v) > 20 else "",
        )


def lora_adapters_json(adapters: dict[str, str]) -> str:
    """NodeInfo.lora_adapters of a node with these adapters (name -> digest)."""
    return json.dumps(dict(sorted(adapters.items())), separators=(",", ":")) if adapters else ""


def lora_adapters_of(node: NodeInfo) -> dict[str, str]:
    """A node's adapters, name -> digest; a malformed field reads as none
    (the node then gets no adapter request, rather than a wrong one)."""
    return dict(_adapters(node.lora_adapters)) if node.lora_adapters else {}


def lora_resident_json(names: list[str]) -> str:
    """NodeInfo.lora_resident of a node with these adapters in device slots."""
    return json.dumps(sorted(names), separators=(",", ":")) if names else ""


def lora_resident_of(node: NodeInfo) -> frozenset[str]:
    """The adapters in a node's device slots (a malformed field reads as none)."""
    return _resident(node.lora_resident) if node.lora_resident else frozenset()


@functools.lru_cache(maxsize=256)
def _resident(text: str) -> frozenset[str]:
    try:
        value = json.loads(text)
    except ValueError:
        return frozenset()
    return (
        frozenset(v for v in value if isinstance(v, str))
        if isinstance(value, list)
        else frozenset()
    )


@functools.lru_cache(maxsize=256)
def _adapters(text: str) -> tuple[tuple[str, str], ...]:
    """Parsed once per distinct field (routing reads it for every request)."""
    try:
        value = json.loads(text)
    except ValueError:
        return ()
    if not isinstance(value, dict):
        return ()
    return tuple((k, v) for k, v in value.items() if isinstance(k, str) and isinstance(v, str))


# (name, type) of each of PACKED_FIELDS, the types as NodeInfo declares them.
_KINDS = {"int": int, "str": str, "bool": bool, "NodeRole": NodeRole}
_DECLARED = {f.name: f.type for f in fields(NodeInfo)}
_PACKED_TYPES = tuple((name, _KINDS[_DECLARED[name]]) for name in PACKED_FIELDS)
# NodeInfo's fields before seen_ms, in order, with their defaults (MISSING: none).
_BEFORE_SEEN = tuple((f.name, f.default) for f in fields(NodeInfo))
_BEFORE_SEEN = _BEFORE_SEEN[: [name for name, _ in _BEFORE_SEEN].index("seen_ms")]


@dataclass(slots=True)
class RouteCandidate:
    node: NodeInfo
    hit_blocks: int  # leading blocks of the request its device pool has published
    drained: bool = False  # an operator drained it (pdctl drain)
    # Blocks after those its host tier has published: copied in, not recomputed.
    host_hit_blocks: int = 0


@dataclass(slots=True)
class ClusterView:
    """What one routing read returns: the server's clock and every live node."""

    now_ms: int  # the Redis server's clock when the read ran
    candidates: list[RouteCandidate]

    def age_ms(self, node: NodeInfo) -> int:
        """Milliseconds since the node's last heartbeat, on the server's clock."""
        return max(0, self.now_ms - node.seen_ms)


def _packed(block_hashes: list[bytes]) -> bytes:
    """The leading MAX_ROUTED_BLOCKS hashes as the script reads them: concatenated."""
    hashes = block_hashes[:MAX_ROUTED_BLOCKS]
    packed = b"".join(hashes)
    if len(packed) != DIGEST_SIZE * len(hashes):
        raise ValueError(f"block hashes must be {DIGEST_SIZE} bytes each")
    return packed


def _int(v: str) -> int:
    return int(v) if v else 0


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def now_ms() -> int:
    return int(time.time() * 1000)


class Cluster:
    """Async access to the shared state; one instance per process."""

    def __init__(self, client: Any, prefix: str = DEFAULT_PREFIX, ttl_s: float = DEFAULT_TTL_S):
        self.redis = client
        self.prefix = prefix
        self.ttl_ms = int(ttl_s * 1000)
        self._route = client.register_script(ROUTE_SCRIPT)
        self._stamp = client.register_script(STAMP_SCRIPT)
        # NodeInfo.from_route's cache: each live node's last route field, parsed.
        self._parsed_routes: dict[str, tuple] = {}
        # The routing script's own connection (common/cluster/redis_script.py says why);
        # None: through redis-py, whose settings it does not all handle.
        self.route_connection = ScriptConnection.for_client(client)

    @classmethod
    def from_url(cls, url: str, connection: dict[str, Any] | None = None, **kwargs: Any) -> Cluster:
        """``connection``: more client options (credentials, TLS: common/cluster/redis_auth.py)."""
        import redis.asyncio as aioredis
        from redis.exceptions import ConnectionError as RedisConnectionError

        timeout = kwargs.pop("socket_timeout", 2.0)
        client = aioredis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # A pooled connection that Redis closed (a restart) fails the command
            # that finds it; one retry at once reconnects it. Without it, every
            # pooled connection failed one command after each restart.
            retry_on_error=[RedisConnectionError],
            **(connection or {}),
        )
        return cls(client, **kwargs)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def heartbeat(
        self,
        info: NodeInfo,
        stored: list[bytes] = (),
        removed: list[bytes] = (),
        reset_blocks: bool = False,
        host_stored: list[bytes] = (),
        host_removed: list[bytes] = (),
    ) -> None:
        """Publish the node's load and both tiers' cache changes; one round trip.
        ``reset_blocks``: the changes are a full snapshot of both tiers."""
        info.updated_ms = now_ms()
        node_key = self._key("node", info.node_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(node_key, mapping=info.to_fields())
        await self._stamp(keys=[node_key], client=pipe)
        pipe.pexpire(node_key, self.ttl_ms)
        pipe.sadd(self._key("nodes"), info.node_id)
        for key, added, gone in (
            (self._key("blocks", info.node_id), stored, removed),
            (self._key("host_blocks", info.node_id), host_stored, host_removed),
        ):
            if reset_blocks:
                pipe.delete(key)
            if gone:
                pipe.srem(key, *gone)
            if added:
                pipe.sadd(key, *added)
            pipe.pexpire(key, self.ttl_ms)
        await pipe.execute()

    async def deregister(self, node_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(
            self._key("node", node_id),
            self._key("blocks", node_id),
            self._key("host_blocks", node_id),
        )
        pipe.srem(self._key("nodes"), node_id)
        await pipe.execute()

    def _route_call(
        self, block_hashes: list[bytes], numerics: NumericsHashes = ()
    ) -> tuple[list[str], list[Any]]:
        args: list[Any] = [self.prefix, _packed(block_hashes)]
        for tag, hashes in numerics:
            args += [tag, _packed(hashes)]
        return [self._key("nodes"), self._key("draining")], args

    async def view(self, block_hashes: list[bytes], numerics: NumericsHashes = ()) -> ClusterView:
        """Every live node with the number of leading request blocks it holds; one
        round trip. ``numerics``: (numerics tag, hashes) of the nodes whose
        engines hash with other numerics than ``block_hashes``'s
        (common/cluster/route_script.py)."""
        keys, args = self._route_call(block_hashes, numerics)
        if self.route_connection is not None:
            raw = await self.route_connection.evalsha(self._route.sha, ROUTE_SCRIPT, keys, args)
        else:
            raw = await self._route(keys=keys, args=args)
        return self._view_of(raw)

    def start_view(self, block_hashes: list[bytes], numerics: NumericsHashes = ()) -> Sent | None:
        """``view``'s read, written now so that the caller's work overlaps its round
        trip; None when it cannot be (no routing connection open yet: use ``view``).
        ``finish_view`` gives the view; a started read nobody finishes is dropped."""
        if self.route_connection is None:
            return None
        call = self._route_call(block_hashes, numerics)
        return self.route_connection.send(self._route.sha, *call)

    async def finish_view(self, started: Sent) -> ClusterView:
        return self._view_of(await self.route_connection.finish(started, ROUTE_SCRIPT))

    def _view_of(self, raw: list[Any]) -> ClusterView:
        """The routing script's flat reply (common/cluster/route_script.py) as a view."""
        out = []
        last, self._parsed_routes = self._parsed_routes, {}  # live nodes only
        i, end = 1, len(raw)
        while i < end:
            node_id = _text(raw[i])
            k = raw[i + 1]
            if node_id in last:
                self._parsed_routes[node_id] = last[node_id]
            info = NodeInfo.from_route(node_id, raw[i + 2 : i + 2 + k], self._parsed_routes)
            out.append(RouteCandidate(info, raw[i + 2 + k], bool(raw[i + 4 + k]), raw[i + 3 + k]))
            i += 5 + k
        return ClusterView(int(raw[0]), out)

    async def candidates(self, block_hashes: list[bytes]) -> list[RouteCandidate]:
        return (await self.view(block_hashes)).candidates

    async def nodes(self) -> list[NodeInfo]:
        """Every live node with all its published fields (for operators, not the hot path)."""
        return (await self.nodes_at())[1]

    async def nodes_at(self) -> tuple[int, list[NodeInfo]]:
        """The Redis server's clock (ms) and every live node, read together."""
        ids = sorted(_text(i) for i in await self.redis.smembers(self._key("nodes")))
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        for node_id in ids:
            pipe.hgetall(self._key("node", node_id))
        pipe.smembers(self._key("draining"))
        (sec, usec), *raws, drained = await pipe.execute()
        drained = {_text(d) for d in drained}
        out = []
        for raw in raws:
            if raw:
                info = NodeInfo.from_fields(raw)
                info.draining = info.draining or info.node_id in drained
                out.append(info)
        return int(sec) * 1000 + int(usec) // 1000, out

    async def drain(self, node_id: str) -> None:
        """No new requests for this node (kept until undrain, across restarts)."""
        await self.redis.sadd(self._key("draining"), node_id)

    async def undrain(self, node_id: str) -> bool:
        """True if the node was drained."""
        return bool(await self.redis.srem(self._key("draining"), node_id))

    async def block_counts(self, node_ids: list[str]) -> dict[str, tuple[int, int]]:
        """Node id -> the block hashes it published (device pool, host tier)."""
        pipe = self.redis.pipeline(transaction=False)
        for node_id in node_ids:
            pipe.scard(self._key("blocks", node_id))
            pipe.scard(self._key("host_blocks", node_id))
        counts = await pipe.execute()
        return {n: (counts[2 * i], counts[2 * i + 1]) for i, n in enumerate(node_ids)}

    async def node_blocks(self, node_id: str, host: bool = False) -> set[bytes]:
        """The hashes a node published for its device pool (or, ``host``, its host tier)."""
        return set(
            await self.redis.smembers(self._key("host_blocks" if host else "blocks", node_id))
        )

    async def close(self) -> None:
        if self.route_connection is not None:
            self.route_connection.close()
        await self.redis.aclose()
