"""Cluster state in Redis: node registry, heartbeats with a TTL, load, block-hash index.

Key schema (DESIGN §4; ``pds`` is the default prefix):

- ``pds:node:{id}``   hash: role, address, transfer endpoint, model id, block size,
                      KV blocks total/free, running, waiting, queued prefill
                      tokens, draining, updated_ms. Expires ``ttl`` seconds after
                      the last heartbeat, so a dead node vanishes by itself.
- ``pds:nodes``       set of node ids; entries whose hash expired are pruned by
                      the routing script when it meets them.
- ``pds:blocks:{id}`` set of the 16-byte block hashes cached on that node (added
                      on insert, removed on eviction); expires with the node.

One heartbeat is one pipelined round trip. One routing decision is one round
trip: a Lua script reads every live node's hash and, with SMISMEMBER, how many
leading blocks of the request each node holds. Hashes are hints: a node that
finds a hash still verifies the block's tokens before reusing it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_PREFIX = "pds"
DEFAULT_TTL_S = 5.0

_ROUTE_SCRIPT = """
local ids = redis.call('SMEMBERS', KEYS[1])
local prefix = ARGV[1]
local out = {}
for _, id in ipairs(ids) do
  local fields = redis.call('HGETALL', prefix .. ':node:' .. id)
  if #fields == 0 then
    redis.call('SREM', KEYS[1], id)
  else
    local hit = 0
    if #ARGV > 1 then
      local flags = redis.call('SMISMEMBER', prefix .. ':blocks:' .. id, unpack(ARGV, 2))
      for i = 1, #flags do
        if flags[i] == 1 then hit = i else break end
      end
    end
    out[#out + 1] = id
    out[#out + 1] = fields
    out[#out + 1] = hit
  end
end
return out
"""
# Lua's unpack() is bounded by the C stack; longer prompts are matched on
# their first this-many blocks (a longer common prefix is rare and still hits
# locally on the node, which verifies every block anyway).
MAX_ROUTED_BLOCKS = 4000


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
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    draining: bool = False
    updated_ms: int = 0
    # Counters since the node started.
    requests_total: int = 0
    preemptions: int = 0
    kv_transfers: int = 0  # sent (prefill node) or landed (decode node)
    kv_transfer_failures: int = 0
    kv_late_transfers: int = 0  # arrived for a reservation that was gone; dropped
    kv_checksum_mismatches: int = 0

    def to_fields(self) -> dict[str, str]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, NodeRole):
                value = value.value
            elif isinstance(value, bool):
                value = int(value)
            out[f.name] = str(value)
        return out

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


@dataclass(slots=True)
class RouteCandidate:
    node: NodeInfo
    hit_blocks: int  # leading blocks of the request this node has published


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
        self._route = client.register_script(_ROUTE_SCRIPT)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Cluster:
        import redis.asyncio as aioredis

        timeout = kwargs.pop("socket_timeout", 2.0)
        client = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        return cls(client, **kwargs)

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def heartbeat(
        self,
        info: NodeInfo,
        stored: list[bytes] = (),
        removed: list[bytes] = (),
        reset_blocks: bool = False,
    ) -> None:
        """Publish the node's load and cache changes; one round trip."""
        info.updated_ms = now_ms()
        node_key = self._key("node", info.node_id)
        blocks_key = self._key("blocks", info.node_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(node_key, mapping=info.to_fields())
        pipe.pexpire(node_key, self.ttl_ms)
        pipe.sadd(self._key("nodes"), info.node_id)
        if reset_blocks:
            pipe.delete(blocks_key)
        if removed:
            pipe.srem(blocks_key, *removed)
        if stored:
            pipe.sadd(blocks_key, *stored)
        pipe.pexpire(blocks_key, self.ttl_ms)
        await pipe.execute()

    async def deregister(self, node_id: str) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self._key("node", node_id), self._key("blocks", node_id))
        pipe.srem(self._key("nodes"), node_id)
        await pipe.execute()

    async def candidates(self, block_hashes: list[bytes]) -> list[RouteCandidate]:
        """Every live node with the number of leading request blocks it holds; one round trip."""
        raw = await self._route(
            keys=[self._key("nodes")], args=[self.prefix, *block_hashes[:MAX_ROUTED_BLOCKS]]
        )
        out = []
        for i in range(0, len(raw), 3):
            flat = raw[i + 1]
            info = NodeInfo.from_fields(dict(zip(flat[::2], flat[1::2], strict=True)))
            out.append(RouteCandidate(info, int(raw[i + 2])))
        return out

    async def nodes(self) -> list[NodeInfo]:
        return [c.node for c in await self.candidates([])]

    async def block_counts(self, node_ids: list[str]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for node_id in node_ids:
            pipe.scard(self._key("blocks", node_id))
        return dict(zip(node_ids, await pipe.execute(), strict=True))

    async def node_blocks(self, node_id: str) -> set[bytes]:
        return set(await self.redis.smembers(self._key("blocks", node_id)))

    async def close(self) -> None:
        await self.redis.aclose()
