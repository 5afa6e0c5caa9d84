"""Routing, decision part: the cost of one routing decision (the rest of the
routing benchmark is benchmarks/routing.py, which runs this part too).

A real redis-server holding 16 synthetic nodes (8 prefill, 8 decode), each with
``--other-blocks`` unrelated cached blocks and a different leading part of the
test prompt. One decision for an 8k-token prompt = hashing its blocks + the
routing read (one Redis round trip, counted on the wire) + the router's
in-flight split + the policy. Baseline in the same run: the previous routing
read (HGETALL of every node + SMISMEMBER of every block). Also reported: the
script's time on the Redis server (INFO commandstats), and hashing the prompt
with hashlib where the C chain (engine/_block_hash.c) did it. The file runs in
older trees too (copy it there), for a before/after of the same figures.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from benchmarks.common import summary_ms

# ---------------------------------------------------------------- decision
# The routing read before this design: every node's whole hash, and an
# SMISMEMBER of every block of the request (linear in the prompt).
_LINEAR_SCRIPT = """
local ids = redis.call('SMEMBERS', KEYS[1])
local out = {}
for _, id in ipairs(ids) do
  local fields = redis.call('HGETALL', ARGV[1] .. ':node:' .. id)
  if #fields > 0 then
    local hit = 0
    if #ARGV > 1 then
      local flags = redis.call('SMISMEMBER', ARGV[1] .. ':blocks:' .. id, unpack(ARGV, 2))
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


class RoundTrips:
    """Counts the requests redis-py writes to its sockets (a pipeline is one); the routing
    script's own connection (common/cluster/redis_script.py) counts its own."""

    def __init__(self) -> None:
        from redis.asyncio.connection import AbstractConnection

        self.count = 0
        self._cls = AbstractConnection
        self._orig = AbstractConnection.send_packed_command
        counter = self

        async def counted(conn, command, check_health=True):
            counter.count += 1
            return await counter._orig(conn, command, check_health)

        AbstractConnection.send_packed_command = counted

    def close(self) -> None:
        self._cls.send_packed_command = self._orig


async def decision_latency(args: argparse.Namespace) -> dict[str, Any]:
    import gc

    from common.cluster.state import Cluster, NodeInfo, NodeRole
    from engine import block_hash
    from engine.block_hash import BlockHasher
    from pdserve.redis_server import RedisServer
    from router.inflight import InflightTracker
    from router.policy import RouteRequest, RoutingConfig, choose_route

    rng = random.Random(args.seed)
    bs = args.block_size
    hasher = BlockHasher("bench-model", bs)
    try:
        hashlib_hasher = BlockHasher("bench-model", bs, native=False)
    except TypeError:  # a tree from before the C chain: hashlib is all it has
        hashlib_hasher = hasher
    prompt = [rng.randrange(32000) for _ in range(args.decision_prompt_tokens)]
    hashes = hasher.hash_blocks(prompt)
    server = RedisServer().start()
    # No live nodes heartbeat here: the synthetic ones are published once and
    # kept (long TTL, staleness limit); freshness does not change the cost.
    cluster = Cluster.from_url(server.url, ttl_s=3600)
    trips = RoundTrips()
    try:
        for i in range(args.decision_nodes):
            role = NodeRole.PREFILL if i % 2 == 0 else NodeRole.DECODE
            info = NodeInfo(
                node_id=f"{role.value}-{i // 2}",
                role=role,
                address=f"10.0.0.{i}:50060",
                model_id="bench-model",
                block_size=bs,
                kv_blocks_total=200_000,
                kv_blocks_free=rng.randrange(50_000, 200_000),
                running=rng.randrange(0, 200),
                queued_prefill_tokens=rng.randrange(0, 20_000),
                max_num_seqs=256,
            )
            # Each node caches a different leading part of the prompt (the
            # first of them none), plus unrelated blocks of other prompts.
            lead = hashes[: (i * len(hashes)) // args.decision_nodes]
            other = [rng.randbytes(16) for _ in range(args.other_blocks)]
            await cluster.heartbeat(info, stored=lead + other, reset_blocks=True)
        linear = cluster.redis.register_script(_LINEAR_SCRIPT)
        tracker = InflightTracker()
        config = RoutingConfig(stale_heartbeat_s=3600)
        request = RouteRequest("bench-model", bs, len(prompt))

        async def decide(turn: int):
            t0 = time.perf_counter()
            hs = hasher.hash_blocks(prompt)
            t1 = time.perf_counter()
            view = await cluster.view(hs)
            t2 = time.perf_counter()
            decision = choose_route(view, request, config, tracker.loads(view), rng, turn)
            t3 = time.perf_counter()
            return (t1 - t0, t2 - t1, t3 - t2), decision, view

        for k in range(50):  # warm up: script cache, connections
            await decide(k)
            await linear(keys=[cluster._key("nodes")], args=[cluster.prefix, *hashes])
        parts: list[tuple[float, float, float]] = []
        await cluster.redis.config_resetstat()
        trips.count = 0
        lean = getattr(cluster, "route_connection", None)  # common/cluster/redis_script.py
        lean_sent = lean.sent if lean is not None else 0
        gc.disable()  # a collection in one sample is noise, not routing
        try:
            for k in range(args.decisions):
                p, decision, view = await decide(k)
                parts.append(p)
                if k % 100 == 99:
                    gc.collect()
        finally:
            gc.enable()
        lean_sent = (lean.sent if lean is not None else 0) - lean_sent
        trips_per_decision = (trips.count + lean_sent) / args.decisions
        stats = await cluster.redis.info("commandstats")
        server_us = stats["cmdstat_evalsha"]["usec_per_call"]
        # Each hasher alone, back to back (in a decision the hashing runs between
        # Redis reads, on colder caches): the implementations compared.
        alone: dict[str, list[float]] = {"default": [], "hashlib": []}
        for _ in range(args.decisions):
            for name, h in (("default", hasher), ("hashlib", hashlib_hasher)):
                t0 = time.perf_counter()
                h.hash_blocks(prompt)
                alone[name].append(time.perf_counter() - t0)
        expected = max(
            (c for c in view.candidates if c.node.role is NodeRole.DECODE),
            key=lambda c: c.hit_blocks,
        )
        linear_s: list[float] = []
        trips.count = 0
        for _ in range(args.decisions):
            t0 = time.perf_counter()
            raw = await linear(keys=[cluster._key("nodes")], args=[cluster.prefix, *hashes])
            linear_s.append(time.perf_counter() - t0)
        linear_trips = trips.count / args.decisions
        linear_hits = {raw[i].decode(): int(raw[i + 2]) for i in range(0, len(raw), 3)}
        ours_hits = {c.node.node_id: c.hit_blocks for c in view.candidates}
    finally:
        trips.close()
        await cluster.close()
        server.stop()

    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    hash_ms, read_ms, policy_ms = (ms([p[i] for p in parts]) for i in range(3))
    total_ms = ms([sum(p) for p in parts])
    without_hash = ms([p[1] + p[2] for p in parts])
    out = {
        "prompt_tokens": len(prompt),
        "blocks": len(hashes),
        "nodes": args.decision_nodes,
        "unrelated_blocks_per_node": args.other_blocks,
        "decisions": args.decisions,
        "redis_round_trips_per_decision": trips_per_decision,
        "native_hashing": getattr(block_hash, "NATIVE_AVAILABLE", False),
        "routing_script_server_us_per_call": server_us,
        "hits_agree_with_linear_scan": linear_hits == ours_hits,
        "chosen_decode_node": decision.decode.node_id,
        "longest_decode_hit_node": expected.node.node_id,
        "hash_blocks": summary_ms(hash_ms),
        "hash_blocks_alone": summary_ms(ms(alone["default"])),
        "hash_blocks_hashlib_alone": summary_ms(ms(alone["hashlib"])),
        "routing_read": summary_ms(read_ms),
        "policy": summary_ms(policy_ms),
        "decision_excluding_hashing": summary_ms(without_hash),
        "decision_including_hashing": summary_ms(total_ms),
        "baseline_linear_read": summary_ms(ms(linear_s)),
        "baseline_round_trips": linear_trips,
    }
    out["read_speedup_vs_linear_p50"] = (
        out["baseline_linear_read"]["p50_ms"] / out["routing_read"]["p50_ms"]
    )
    print(
        f"decision for {len(prompt)} tokens over {args.decision_nodes} nodes: "
        f"p50 {out['decision_including_hashing']['p50_ms']:.3f} ms "
        f"(hashing {out['hash_blocks']['p50_ms']:.3f}, Redis read {out['routing_read']['p50_ms']:.3f}, "
        f"policy {out['policy']['p50_ms']:.3f}), p99 {out['decision_including_hashing']['p99_ms']:.3f} ms; "
        f"{trips_per_decision:g} Redis round trips; the script {server_us:.0f} us on the server; "
        f"hashing alone {out['hash_blocks_alone']['p50_ms']:.3f} ms, with hashlib "
        f"{out['hash_blocks_hashlib_alone']['p50_ms']:.3f} ms "
        f"(C chain: {'yes' if out['native_hashing'] else 'no'}); linear read p50 "
        f"{out['baseline_linear_read']['p50_ms']:.3f} ms",
        flush=True,
    )
    return out
