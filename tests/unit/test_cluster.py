"""The Redis registry and block index against a real redis-server."""

from __future__ import annotations

import asyncio

import pytest

from common.block_hash import hash_prompt_blocks
from common.cluster import Cluster, NodeInfo, NodeRole
from common.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def run(coro):
    return asyncio.run(coro)


def node(node_id, role=NodeRole.PREFILL, **kw):
    return NodeInfo(
        node_id=node_id,
        role=role,
        address=f"127.0.0.1:{hash(node_id) % 1000 + 40000}",
        model_id="m",
        block_size=16,
        kv_blocks_total=100,
        kv_blocks_free=kw.pop("free", 100),
        **kw,
    )


def test_heartbeat_registers_and_routing_counts_prefix_hits(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t1")
        hashes = hash_prompt_blocks(list(range(160)), "m", 16)  # 10 blocks
        await cluster.heartbeat(node("p0"), stored=hashes[:6], reset_blocks=True)
        await cluster.heartbeat(node("p1"), stored=hashes[:2] + hashes[3:9], reset_blocks=True)
        await cluster.heartbeat(node("d0", NodeRole.DECODE, free=40), reset_blocks=True)
        cands = {c.node.node_id: c for c in await cluster.candidates(hashes)}
        assert set(cands) == {"p0", "p1", "d0"}
        assert cands["p0"].hit_blocks == 6
        assert cands["p1"].hit_blocks == 2  # only the leading run counts
        assert cands["d0"].hit_blocks == 0
        d0 = cands["d0"].node
        assert d0.role is NodeRole.DECODE and d0.kv_blocks_free == 40 and d0.updated_ms > 0
        # Evictions are published too.
        await cluster.heartbeat(node("p0"), removed=hashes[3:6])
        cands = {c.node.node_id: c for c in await cluster.candidates(hashes)}
        assert cands["p0"].hit_blocks == 3
        await cluster.close()

    run(go())


def test_dead_nodes_expire_and_are_pruned(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t2", ttl_s=0.3)
        await cluster.heartbeat(node("p0"), stored=[b"x" * 16], reset_blocks=True)
        assert [n.node_id for n in await cluster.nodes()] == ["p0"]
        await asyncio.sleep(0.5)
        assert await cluster.nodes() == []
        assert not await cluster.redis.sismember("t2:nodes", "p0")  # pruned from the set
        assert await cluster.node_blocks("p0") == set()  # the block set expired too
        await cluster.close()

    run(go())


def test_restart_resets_the_block_set_and_deregister_removes_everything(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t3")
        await cluster.heartbeat(node("p0"), stored=[b"a" * 16, b"b" * 16], reset_blocks=True)
        await cluster.heartbeat(
            node("p0"), stored=[b"c" * 16], reset_blocks=True
        )  # a restarted node
        assert await cluster.node_blocks("p0") == {b"c" * 16}
        await cluster.deregister("p0")
        assert await cluster.nodes() == []
        await cluster.close()

    run(go())


def test_node_info_round_trips_through_redis_fields():
    info = node(
        "x",
        NodeRole.DECODE,
        running=3,
        waiting=2,
        queued_prefill_tokens=77,
        draining=True,
        transfer_host="10.0.0.1",
        transfer_port=29500,
    )
    back = NodeInfo.from_fields({k.encode(): v.encode() for k, v in info.to_fields().items()})
    assert back == info
