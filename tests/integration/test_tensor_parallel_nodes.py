"""Prefill and decode nodes of different tensor-parallel sizes, through a real cluster.

The demo model (3 KV heads) on a real cluster (Redis, router, nodes and their
ranks in their own processes, KV over gloo): prefill-0 and decode-1 run with
``--tensor-parallel-size 3`` (one KV head per rank), prefill-1 and decode-0
with 1. Draining the others picks the pair under test, so each of
TP 3 -> 1, 1 -> 3, 3 -> 3 and 1 -> 1 carries real prompts: every rank of the
decode node receives exactly its heads from the prefill ranks that hold them,
and the text equals HF transformers'. Between nodes of one rank (and only
there) the first token comes on the KV channel, before the Prefill's reply
(no ``--verify-kv`` here, so the decode node decodes from it at once). Every block is free on every node after.
prefill-0 streams only each step's last 4 layers, the layers before in one
chunk (``--kv-stream-last-layers 4``, a GPU's default); prefill-1 every layer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto.client import generate
from tests.conftest import REMOTE_PREFILL_ONLY, hf_greedy_ids
from tests.faults.harness import nodes, set_drained, wait_idle

pytestmark = pytest.mark.timeout(900)

NEW_TOKENS = 12
BLOCK = 16
TP = {"prefill-0": 3, "prefill-1": 1, "decode-0": 1, "decode-1": 3}
PROMPTS = [
    "The capital of France is",
    # Over 64 tokens: several prefill chunks on prefill-0, streamed step by step.
    "Summarize the following notes. " + "The river rose after three days of rain. " * 10,
]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    tp3 = {"PDSERVE_TENSOR_PARALLEL_SIZE": "3"}
    spec = ClusterSpec(
        model=str(demo_model_dir),
        num_prefill=2,
        num_decode=2,
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", "512"],
        node_args=["--heartbeat-interval", "0.1"],
        router_args=REMOTE_PREFILL_ONLY,
        component_env={
            "prefill-0": tp3
            | {
                "PDSERVE_MAX_NUM_BATCHED_TOKENS": "64",
                "PDSERVE_MAX_NUM_SEQS": "8",
                "PDSERVE_KV_STREAM_LAST_LAYERS": "4",
            },
            "decode-1": tp3,
        },
        log_dir=str(tmp_path_factory.mktemp("tp-logs")),
        start_timeout_s=600,
    )
    with LocalCluster(spec) as c:
        yield c


def run(cluster, ids: list[int]):
    tokens, final = [], None
    for r in generate(
        cluster.router_address, token_ids=ids, max_tokens=NEW_TOKENS, temperature=0.0, timeout=180
    ):
        for d in r.deltas:
            tokens.extend(d.token_ids)
        if r.HasField("final"):
            final = r.final
    return tokens, final


def only(cluster, *chosen: str) -> None:
    """Drain every node but ``chosen`` (none chosen: undrain them all)."""
    for node in TP:
        set_drained(cluster, node, bool(chosen) and node not in chosen)


def landed_bytes(cluster, decode: str) -> int:
    return nodes(cluster)[decode].kv_transfer_bytes


def block_bytes(demo_model_dir) -> int:
    from engine.models.config import ModelArchConfig

    cfg = ModelArchConfig.from_dir(str(demo_model_dir))
    return 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32


def test_each_node_registers_its_tensor_parallel_size_and_pdctl_shows_it(cluster):
    infos = nodes(cluster)
    assert {n: infos[n].tensor_parallel_size for n in TP} == TP
    assert all(infos[n].num_gpus == 0 for n in TP)  # a CPU host: no GPUs held
    cmd = [sys.executable, "-m", "router.admin.pdctl", "--address", cluster.admin_address, "nodes"]
    listed = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, timeout=60).stdout)
    assert {r["node_id"]: r["tensor_parallel_size"] for r in listed} == TP
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    assert "TP" in table.splitlines()[0] and "GPUS" in table.splitlines()[0]
    # What each computes in and stores KV in (fp32 on a CPU, no --kv-cache-dtype).
    assert {(r["weight_dtype"], r["kv_cache_dtype"]) for r in listed} == {("float32", "float32")}
    assert "WEIGHTS" in table.splitlines()[0] and "KV DTYPE" in table.splitlines()[0]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [
        ("prefill-0", "decode-0"),
        ("prefill-1", "decode-1"),
        ("prefill-0", "decode-1"),
        ("prefill-1", "decode-0"),
    ],
    ids=["tp3-to-tp1", "tp1-to-tp3", "tp3-to-tp3", "tp1-to-tp1"],
)
def test_text_equals_hf_across_tensor_parallel_sizes(
    cluster, hf_demo, demo_tokenizer, demo_model_dir, prefill, decode
):
    tokenizer = demo_tokenizer
    only(cluster, prefill, decode)
    try:
        before = landed_bytes(cluster, decode)
        blocks = 0
        for text in PROMPTS:
            ids = tokenizer.encode(f"[{prefill} to {decode}] {text}")  # new to every cache
            blocks += -(-len(ids) // BLOCK)
            tokens, final = run(cluster, ids)
            assert tokens == hf_greedy_ids(hf_demo, ids, NEW_TOKENS), text
            assert (final.usage.prefill_node, final.usage.decode_node) == (prefill, decode)
        wait_idle(cluster, timeout_s=30)
        deadline = time.monotonic() + 5
        while landed_bytes(cluster, decode) - before < blocks * block_bytes(demo_model_dir):
            assert time.monotonic() < deadline, "the decode node did not count all that landed"
            time.sleep(0.1)
    finally:
        only(cluster)
    # Every head of every block landed once, on the rank that holds it.
    assert landed_bytes(cluster, decode) - before == blocks * block_bytes(demo_model_dir)
    infos = nodes(cluster)
    assert infos[decode].kv_transfer_failures == infos[decode].kv_late_transfers == 0
