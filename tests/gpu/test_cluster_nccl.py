"""The disaggregated service on two GPUs: KV streamed over NCCL between real processes.

Run on a host with two GPUs: ``python -m pytest tests/gpu -m multi_gpu``.

The prefill node streams one layer per chunk (the default) and prefills in
256-token chunks, so a long prompt streams step by step; both nodes checksum
every chunk (``--verify-kv``). The prefill node runs async scheduling (on by
default on CUDA) and piecewise CUDA graphs for its 256-token steps, the streaming
hook between their pieces; the decode node keeps its CUDA graphs.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.cluster.state import Cluster, NodeRole
from engine import LLM, SamplingParams
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from tests.conftest import DEMO_MODEL_DIR, REMOTE_PREFILL_ONLY, needs_demo_model
from tests.integration.test_cluster import PROMPTS, collect

pytestmark = [
    pytest.mark.multi_gpu,
    needs_demo_model,
]


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    spec = ClusterSpec(
        model=str(DEMO_MODEL_DIR),
        num_prefill=1,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        # The test's own offline engine shares GPU 0 with the decode node.
        engine_args=[
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",
            "--gpu-memory-utilization",
            "0.4",
        ],
        node_args=["--verify-kv", "--heartbeat-interval", "0.2"],
        component_env={
            "prefill-0": {"PDSERVE_MAX_NUM_BATCHED_TOKENS": "256", "PDSERVE_KV_STREAM_LAYERS": "1"}
        },
        # Every prompt crosses NCCL (short prompts would be prefilled on the
        # decode node otherwise: docs/routing.md, conditional disaggregation).
        router_args=REMOTE_PREFILL_ONLY,
        log_dir=str(tmp_path_factory.mktemp("nccl-logs")),
        start_timeout_s=600,
    )
    with LocalCluster(spec) as c:
        yield c


def test_nodes_run_on_separate_gpus_and_outputs_match_offline(gpu_cluster):
    params = dict(temperature=0.0, max_tokens=24)
    with ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(lambda p: collect(gpu_cluster.router_address, p, **params), PROMPTS)
        )
    offline = LLM(str(DEMO_MODEL_DIR), max_model_len=1024, dtype="float32", num_kvcache_blocks=1024)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, SamplingParams(**params))]
    del offline
    torch.cuda.empty_cache()
    assert [r[0] for r in results] == expected
    assert all(r[2].usage.prefill_node == "prefill-0" for r in results)  # every prompt crossed NCCL

    async def nodes():
        c = Cluster.from_url(gpu_cluster.redis_url)
        try:
            return await c.nodes()
        finally:
            await c.close()

    time.sleep(0.6)
    by_role = {n.role: n for n in asyncio.run(nodes())}
    decode, prefill = by_role[NodeRole.DECODE], by_role[NodeRole.PREFILL]
    assert decode.kv_transfers == prefill.kv_transfers >= len(PROMPTS)
    assert decode.kv_checksum_mismatches == 0 and decode.kv_transfer_failures == 0


# About 600 and 750 tokens: several 256-token chunks, under the cluster's max_model_len (1024).
LONG_PROMPTS = [
    "Summarize these notes. " + "The committee met on Tuesday to review the budget. " * 60,
    "Continue the list: " + ", ".join(f"item {i}" for i in range(140)),
]


def test_long_prompts_stream_chunk_by_chunk_over_nccl_and_match_offline(gpu_cluster):
    # Over 256 tokens: several prefill steps, each streaming its blocks layer by layer.
    greedy = dict(temperature=0.0, max_tokens=16)
    seeded = dict(temperature=0.8, top_p=0.95, seed=7, max_tokens=16)
    with ThreadPoolExecutor(4) as pool:
        got = list(
            pool.map(
                lambda args: collect(gpu_cluster.router_address, args[0], **args[1]),
                [(p, params) for p in LONG_PROMPTS for params in (greedy, seeded)],
            )
        )
    offline = LLM(str(DEMO_MODEL_DIR), max_model_len=1024, dtype="float32", num_kvcache_blocks=1024)
    expected = [
        offline.generate([p], SamplingParams(**params))[0].outputs[0].token_ids
        for p in LONG_PROMPTS
        for params in (greedy, seeded)
    ]
    del offline
    torch.cuda.empty_cache()
    assert [g[0] for g in got] == expected
    assert all(g[2].usage.prefill_node == "prefill-0" for g in got)
    assert all(g[2].usage.timing.prefill_compute_ms > 0 for g in got)
