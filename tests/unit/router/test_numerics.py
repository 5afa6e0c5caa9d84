"""The router hashes a prompt as each node's engine does, per numerics class
(weight quantization, KV cache dtype), from the node's registration alone."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from common.cluster.numerics import node_numerics_keys, node_numerics_tag
from common.cluster.state import Cluster, NodeInfo, NodeRole
from common.runtime.node import NodeEngine
from common.runtime.node_lora import NodeAdapters
from engine.block_hash import hash_prompt_blocks, numerics_extra_keys
from engine.config import EngineConfig
from engine.kv_cache_dtype import FP8_E4M3_NAME
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pdserve.redis_server import RedisServer
from proto import pdserve_pb2
from router.frontend import Frontend
from router.models import BASE_MODEL
from router.routing import Routing

BLOCK_SIZE = 16
PROMPT = [(7 * i + 3) % 500 for i in range(3 * BLOCK_SIZE + 5)]  # 3 full blocks
# One engine per numerics class: plain, FP8 KV, FP8 weights, both.
CLASSES = [{}, {"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}, {
    "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}]  # fmt: skip


ENGINE = dict(skip_tokenizer_init=True, device="cpu", max_model_len=256, num_kvcache_blocks=16,
              kvcache_block_size=BLOCK_SIZE, enforce_eager=True)  # fmt: skip


@pytest.fixture(scope="module")
def nodes(tiny_llama_dir):
    """(registration, the hashes its engine published for PROMPT) per class."""
    out = []
    for i, numerics in enumerate(CLASSES):
        llm = LLM(str(tiny_llama_dir), **ENGINE, **numerics)
        engine = llm.llm_engine
        engine.enable_cache_events()
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1), use_tqdm=False)
        published = engine.take_cache_events().stored
        node = NodeEngine(engine.config, engine, None, f"n{i}", "127.0.0.1", None, NodeAdapters())
        out.append((node.info(NodeRole.DECODE, 1), published))
    return out


@pytest.fixture(scope="module")
def frontend(tiny_llama_dir):
    return Frontend(EngineConfig.from_kwargs(str(tiny_llama_dir), **ENGINE))


def test_the_router_computes_each_node_s_own_hashes(nodes, frontend):
    infos = [info for info, _ in nodes]
    frontend.numerics.observe(infos)
    hashes = frontend.block_hashes(PROMPT, "", BASE_MODEL)
    # Four classes, four sets of digests: no two numerics alias.
    assert len(hashes.by_numerics) == len(CLASSES)
    assert len({h[0] for h in hashes.by_numerics.values()}) == len(CLASSES)
    for info, published in nodes:
        mine = hashes.by_numerics[node_numerics_keys(info)]
        assert len(mine) == 3 and sorted(published) == sorted(mine), info.node_id
    # The routing read searches the primary list for one class and each other
    # class's list for its nodes' tags.
    primary, others = hashes.route_args(frontend.numerics.tags)
    assert primary == hashes.primary
    tagged = dict(others)
    for info, published in nodes:
        if sorted(published) != sorted(primary):
            assert sorted(tagged[node_numerics_tag(info)]) == sorted(published)


def test_registrations_name_the_numerics(nodes):
    got = [(info.weight_dtype, info.kv_cache_dtype) for info, _ in nodes]
    assert got == [("float32", "float32"), ("float32", "fp8_e4m3"), ("fp8", "float32"),
                   ("fp8", "fp8_e4m3")]  # fmt: skip
    assert node_numerics_keys(nodes[0][0]) == ()
    assert node_numerics_keys(nodes[3][0]) == ("kv_cache_dtype=fp8_e4m3", "quantization=fp8")


def test_a_homogeneous_fp8_cluster_costs_one_hash_pass(nodes, frontend):
    fp8_kv, published = nodes[1]
    frontend.numerics.observe([fp8_kv, fp8_kv])
    hashes = frontend.block_hashes(PROMPT, "", BASE_MODEL)
    assert list(hashes.by_numerics) == [node_numerics_keys(fp8_kv)]
    assert sorted(hashes.primary) == sorted(published)
    assert hashes.route_args(frontend.numerics.tags) == (hashes.primary, [])
    # Nodes of another model teach nothing: the classes stay as they were.
    frontend.numerics.observe([replace(nodes[0][0], model_id="another")])
    assert frontend.numerics.classes == (node_numerics_keys(fp8_kv),)


def test_routing_and_its_explanation_count_fp8_hits_in_fp8_hashes(frontend):
    # A bf16 prefill node and an FP8-cache decode node (the mixed pairing), each
    # publishing what its engine hashes; the router learns the classes from its
    # first read and counts each node's hit in its own class.
    ids = list(range(10 * BLOCK_SIZE))
    plain = hash_prompt_blocks(ids, frontend.model_id, BLOCK_SIZE)
    fp8 = hash_prompt_blocks(
        ids, frontend.model_id, BLOCK_SIZE, extra_keys=numerics_extra_keys(None, FP8_E4M3_NAME)
    )

    def registered(node_id, role, kv):
        return NodeInfo(node_id, role, f"127.0.0.1:{4000 + len(node_id)}", frontend.model_id,
                        BLOCK_SIZE, kv_blocks_total=100, kv_blocks_free=100, max_num_seqs=8,
                        weight_dtype="bfloat16", kv_cache_dtype=kv)  # fmt: skip

    async def go(url):
        cluster = Cluster.from_url(url)
        routing = Routing(cluster, frontend.model_id, BLOCK_SIZE, numerics=frontend.numerics)
        prefill = registered("p0", NodeRole.PREFILL, "bfloat16")
        await cluster.heartbeat(prefill, stored=plain[:6], reset_blocks=True)
        decode = registered("d0", NodeRole.DECODE, FP8_E4M3_NAME)
        await cluster.heartbeat(decode, stored=fp8[:4], reset_blocks=True)
        await routing.read_nodes()
        request = pdserve_pb2.GenerateRequest(
            token_ids=pdserve_pb2.TokenIds(ids=ids), sampling={"max_tokens": 4}
        )
        parsed = frontend.parse(request)
        assert len(parsed.block_hashes.by_numerics) == 2
        routed = await routing.route(parsed)
        await routing.close()
        await cluster.close()
        return routed

    with RedisServer() as server:
        routed = asyncio.run(go(server.url))
    hits = {c.node.node_id: c.hit_blocks for c in routed.view.candidates}
    assert hits == {"p0": 6, "d0": 4}
    # What pdctl explain shows (every node scored, prefill nodes too): each hit.
    assert {s.node_id: s.hit_blocks for s in routed.decision.scores} == hits
