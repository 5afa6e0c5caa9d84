"""The Redis registry and block index against a real redis-server."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from common.cluster.numerics import node_numerics_tag
from common.cluster.route_script import ROUTE_FIELDS, ROUTE_KEY
from common.cluster.state import Cluster, NodeInfo, NodeRole
from engine.block_hash import hash_prompt_blocks, numerics_extra_keys
from pdserve.redis_server import RedisServer


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
        await cluster.heartbeat(node("p0", max_num_seqs=64), stored=hashes[:6], reset_blocks=True)
        await cluster.heartbeat(node("d0", NodeRole.DECODE, free=40), reset_blocks=True)
        view = await cluster.view(hashes)
        cands = {c.node.node_id: c for c in view.candidates}
        assert set(cands) == {"p0", "d0"}
        assert cands["p0"].hit_blocks == 6
        assert cands["d0"].hit_blocks == 0
        p0, d0 = cands["p0"].node, cands["d0"].node
        assert p0.max_num_seqs == 64 and p0.address == node("p0").address
        assert d0.role is NodeRole.DECODE and d0.kv_blocks_free == 40
        # Ages are read on the server's clock, whatever the node's clock says.
        assert d0.seen_ms > 0 and 0 <= view.age_ms(d0) < 1000
        # Evictions are published too.
        await cluster.heartbeat(node("p0"), removed=hashes[3:6])
        cands = {c.node.node_id: c for c in await cluster.candidates(hashes)}
        assert cands["p0"].hit_blocks == 3
        await cluster.close()

    run(go())


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 7, 8, 9, 64, 100])
def test_the_prefix_search_is_exact_on_prefix_closed_sets(redis_url, num_blocks):
    # What nodes publish is prefix-closed (see test_block_manager); on such a
    # set the bisection finds the same leading run a linear scan would.
    async def go():
        cluster = Cluster.from_url(redis_url, prefix=f"t5-{num_blocks}")
        hashes = hash_prompt_blocks(list(range(16 * num_blocks)), "m", 16)
        for held in range(num_blocks + 1):
            await cluster.heartbeat(node("p0"), stored=hashes[:held], reset_blocks=True)
            (cand,) = await cluster.candidates(hashes)
            assert cand.hit_blocks == held
        await cluster.close()

    run(go())


# Hits where a bisection's bounds meet: none, one, every block, one short of
# them, and each side of every power of two (the midpoints' neighbourhood).
EDGE_HITS = sorted({0, 1, 2, 511, 512} | {2**k + d for k in range(1, 9) for d in (-1, 0, 1)})


def test_the_prefix_search_is_exact_at_its_edges_on_an_8k_token_prompt(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t5-edges")
        hashes = hash_prompt_blocks(list(range(16 * 512)), "m", 16)
        for held in EDGE_HITS:
            await cluster.heartbeat(node("p0"), stored=hashes[:held], reset_blocks=True)
            (cand,) = await cluster.candidates(hashes)
            assert cand.hit_blocks == held
            # A prompt shorter or longer than what is held by one block.
            for n in {max(held - 1, 0), held + 1}:
                (cand,) = await cluster.candidates(hashes[:n])
                assert cand.hit_blocks == min(held, n)
        await cluster.close()

    run(go())


def test_a_set_with_holes_is_credited_between_its_leading_run_and_its_last_block(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t6")
        hashes = hash_prompt_blocks(list(range(160)), "m", 16)  # 10 blocks
        await cluster.heartbeat(node("p1"), stored=hashes[:2] + hashes[3:9], reset_blocks=True)
        (cand,) = await cluster.candidates(hashes)
        assert 2 <= cand.hit_blocks <= 9
        # Random holes: never below the leading run, never past the last held block.
        rng = random.Random(6)
        hashes = hash_prompt_blocks(list(range(16 * 100)), "m", 16)
        for _ in range(30):
            held = [i for i in range(100) if rng.random() < rng.random()]
            await cluster.heartbeat(node("p1"), stored=[hashes[i] for i in held], reset_blocks=True)
            (cand,) = await cluster.candidates(hashes)
            run_ = next(i for i in range(101) if i not in held)
            assert run_ <= cand.hit_blocks <= (held[-1] + 1 if held else 0)
        await cluster.close()

    run(go())


def test_drained_nodes_are_flagged_until_undrained(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t7")
        await cluster.heartbeat(node("p0"), reset_blocks=True)
        await cluster.drain("p0")
        (cand,) = await cluster.candidates([])
        assert cand.drained
        assert [n.draining for n in await cluster.nodes()] == [True]
        assert await cluster.undrain("p0") and not await cluster.undrain("p0")
        (cand,) = await cluster.candidates([])
        assert not cand.drained
        await cluster.close()

    run(go())


def test_dead_nodes_expire_and_are_pruned(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t2", ttl_s=0.3)
        await cluster.heartbeat(node("p0"), stored=[b"x" * 16], reset_blocks=True)
        assert [n.node_id for n in await cluster.nodes()] == ["p0"]
        await asyncio.sleep(0.5)
        assert await cluster.nodes() == []
        assert await cluster.candidates([]) == []  # the routing read prunes the set
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


def busy(node_id: str, **kw) -> NodeInfo:
    """A decode node with every routing field away from its default."""
    return node(
        node_id,
        NodeRole.DECODE,
        running=3,
        waiting=2,
        queued_prefill_tokens=77,
        draining=True,
        transfer_host="10.0.0.1",
        transfer_port=29500,
        tensor_parallel_size=2,
        weight_dtype="bfloat16",
        kv_cache_dtype="fp8_e4m3",
        **kw,
    )


def test_node_info_round_trips_through_redis_fields():
    info = busy("x")
    back = NodeInfo.from_fields({k.encode(): v.encode() for k, v in info.to_fields().items()})
    assert back == info


def routing_fields(info: NodeInfo) -> tuple:
    return tuple(getattr(info, name) for name in ("node_id", *ROUTE_FIELDS))


def test_the_routing_read_takes_the_packed_route_field(redis_url):
    # The script reads `route` and `seen_ms` only; every routing field comes back.
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t8")
        info = busy("d1", free=40, max_num_seqs=64)
        info.model_id = 'a model \u00e9 "quoted"'
        await cluster.heartbeat(info, reset_blocks=True)
        raw = await cluster.redis.hget("t8:node:d1", ROUTE_KEY)
        assert json.loads(raw)[0] == "decode"
        (cand,) = await cluster.candidates([])
        assert cand.node.seen_ms > 0
        info.seen_ms = cand.node.seen_ms
        assert routing_fields(cand.node) == routing_fields(info)
        # Read again (the parsed route is reused) and after the node's load changed.
        (again,) = await cluster.candidates([])
        assert routing_fields(again.node) == routing_fields(info) and again.node is not cand.node
        info.running, info.kv_blocks_free = 9, 11
        await cluster.heartbeat(info)
        (changed,) = await cluster.candidates([])
        assert (changed.node.running, changed.node.kv_blocks_free) == (9, 11)
        await cluster.close()

    run(go())


def test_a_node_hash_without_the_route_field_is_read_field_by_field(redis_url):
    # Written by a node of an earlier version: a new router still routes to it.
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t9")
        hashes = hash_prompt_blocks(list(range(160)), "m", 16)
        info = node(
            "p2",
            running=5,
            queued_prefill_tokens=12,
            tensor_parallel_size=4,
            kv_cache_dtype="fp8_e4m3",
        )
        await cluster.heartbeat(info, stored=hashes[:4], reset_blocks=True)
        await cluster.redis.hdel("t9:node:p2", ROUTE_KEY)
        # Beside a node that has the field: the flat reply holds both shapes.
        await cluster.heartbeat(node("d3", NodeRole.DECODE), stored=hashes[:2], reset_blocks=True)
        await cluster.drain("d3")
        cands = {c.node.node_id: c for c in await cluster.candidates(hashes)}
        cand, other = cands["p2"], cands["d3"]
        assert (other.hit_blocks, other.drained, other.node.role) == (2, True, NodeRole.DECODE)
        assert cand.hit_blocks == 4 and not cand.drained
        info.seen_ms = cand.node.seen_ms
        assert cand.node.seen_ms > 0
        assert routing_fields(cand.node) == routing_fields(info)
        await cluster.close()

    run(go())


def test_a_route_field_with_fewer_or_more_fields_keeps_defaults_or_ignores_the_rest():
    # Fields are appended at the end of ROUTE_FIELDS: an older node packs fewer
    # (the rest keep NodeInfo's defaults), a newer one more (ignored here).
    full = json.loads(node("n", NodeRole.DECODE, running=4).route_value())
    older = NodeInfo.from_route("n", [json.dumps(full[:5]).encode(), b"7"])
    assert (older.role, older.block_size, older.running, older.seen_ms) == (
        NodeRole.DECODE,
        16,
        0,
        7,
    )
    newer = NodeInfo.from_route("n", [json.dumps([*full, 99, "x"]).encode(), None])
    assert (newer.running, newer.seen_ms) == (4, 0)
    # Role, address, model id and block size are required.
    with pytest.raises(ValueError, match="lacks a required field"):
        NodeInfo.from_route("n", [json.dumps(full[:3]).encode(), b"7"])


def test_the_host_tier_is_searched_after_the_device_hit_in_the_same_read(redis_url):
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t-host")
        hashes = hash_prompt_blocks(list(range(16 * 12)), "m", 16)  # 12 blocks
        # Device blocks 0-3, host blocks 4-8 (and 0-1 there too: loaded back).
        await cluster.heartbeat(
            node("p0"), stored=hashes[:4], host_stored=hashes[:2] + hashes[4:9], reset_blocks=True
        )
        await cluster.heartbeat(node("p1"), host_stored=hashes[:6], reset_blocks=True)
        await cluster.heartbeat(node("d0", NodeRole.DECODE), stored=hashes, reset_blocks=True)
        await cluster.heartbeat(node("d1", NodeRole.DECODE), reset_blocks=True)
        cands = {c.node.node_id: c for c in await cluster.candidates(hashes)}
        hits = {n: (c.hit_blocks, c.host_hit_blocks) for n, c in cands.items()}
        assert hits == {"p0": (4, 5), "p1": (0, 6), "d0": (12, 0), "d1": (0, 0)}
        # A host block that does not continue the device hit is no host hit.
        await cluster.heartbeat(node("p1"), stored=hashes[:2], host_removed=hashes[2:3])
        cands = {c.node.node_id: c for c in await cluster.candidates(hashes)}
        assert (cands["p1"].hit_blocks, cands["p1"].host_hit_blocks) == (2, 0)
        # Evictions from the tier are published; the counts and the sets read back.
        await cluster.heartbeat(node("p0"), host_removed=hashes[6:9])
        cands = {c.node.node_id: c for c in await cluster.candidates(hashes)}
        assert (cands["p0"].hit_blocks, cands["p0"].host_hit_blocks) == (4, 2)
        counts = await cluster.block_counts(["p0", "p1", "d1"])
        assert counts == {"p0": (4, 4), "p1": (2, 5), "d1": (0, 0)}
        assert await cluster.node_blocks("p0", host=True) == set(hashes[:2] + hashes[4:6])
        # A restart's snapshot replaces both sets; deregistering removes both.
        await cluster.heartbeat(node("p0"), host_stored=hashes[:1], reset_blocks=True)
        assert await cluster.block_counts(["p0"]) == {"p0": (0, 1)}
        await cluster.deregister("p0")
        assert await cluster.block_counts(["p0"]) == {"p0": (0, 0)}
        await cluster.close()

    run(go())


def test_each_node_is_searched_with_the_hashes_of_its_own_numerics(redis_url):
    # A bf16 prefill node feeding an FP8-cache decode node: each publishes the
    # hashes its engine computes, and one read searches each with its class's.
    async def go():
        cluster = Cluster.from_url(redis_url, prefix="t12")
        ids = list(range(160))
        plain = hash_prompt_blocks(ids, "m", 16)
        fp8_keys = numerics_extra_keys(None, "fp8_e4m3")
        fp8 = hash_prompt_blocks(ids, "m", 16, extra_keys=fp8_keys)
        bf16 = dict(weight_dtype="bfloat16", kv_cache_dtype="bfloat16")
        await cluster.heartbeat(node("p0", **bf16), stored=plain[:6], reset_blocks=True)
        fp8_node = node("d0", NodeRole.DECODE, weight_dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
        await cluster.heartbeat(fp8_node, stored=fp8[:4], reset_blocks=True)
        await cluster.heartbeat(node("d1", NodeRole.DECODE, **bf16), reset_blocks=True)
        # The FP8 class is tagged by the node's two registered fields.
        tag = node_numerics_tag(fp8_node)
        hits = {c.node.node_id: c.hit_blocks for c in await cluster.candidates(plain)}
        assert hits == {"p0": 6, "d0": 0, "d1": 0}  # plain hashes never match FP8 blocks
        view = await cluster.view(plain, [(tag, fp8)])
        hits = {c.node.node_id: c.hit_blocks for c in view.candidates}
        assert hits == {"p0": 6, "d0": 4, "d1": 0}
        # The FP8 list as the primary one: the bf16 nodes under their own tag.
        view = await cluster.view(fp8, [(node_numerics_tag(node("p0", **bf16)), plain)])
        assert {c.node.node_id: c.hit_blocks for c in view.candidates}["p0"] == 6
        # A tag nobody registered changes nothing.
        view = await cluster.view(plain, [("fp8/fp8_e4m3", fp8)])
        assert {c.node.node_id: c.hit_blocks for c in view.candidates}["d0"] == 0
        await cluster.close()

    run(go())
