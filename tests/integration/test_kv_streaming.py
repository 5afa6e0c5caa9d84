"""Layer-wise KV streaming through a real cluster, against HF transformers.

One decode node and two prefill nodes (real processes, a real Redis, KV over
gloo, every transfer checksummed per chunk by both sides): prefill-0 streams
one layer per chunk of a step's last 5 layers, the layers before them in one
chunk (``--kv-stream-last-layers 5``; every layer streamed, the CPU default,
is what the fault tests' clusters run), and prefills in 64-token chunks (a
long prompt streams step by step); prefill-1 sends each step's blocks of every
layer in one chunk after its last layer (``--kv-stream-layers 0``). Each test drains the other
prefill node, so the path under test is the one taken. The decode node sends
its Prefills on a PrefillSession per prefill node, each before it reserves
the prompt's blocks, which follow on the session (PrefillRequest.blocks_follow;
the first Prefill of a session goes after them, the node's support not known
yet); tests/integration/test_cluster.py's decode-1 sends a call per Prefill.
"""

from __future__ import annotations

import time

import pytest

from common.cluster.state import NodeRole
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto.client import generate
from tests.conftest import REMOTE_PREFILL_ONLY, hf_greedy_ids
from tests.faults.harness import nodes, set_drained, wait_idle

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 16
BLOCK = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Les mathématiques sont",
    # Over 64 tokens: prefilled in several chunks on prefill-0.
    "Summarize the following notes. " + "The river rose after three days of rain. " * 12,
]
LAYERS = {"prefill-0": 1, "prefill-1": 0}


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    spec = ClusterSpec(
        model=str(demo_model_dir),
        num_prefill=2,
        num_decode=1,
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", "1024"],
        node_args=["--verify-kv", "--heartbeat-interval", "0.1"],
        router_args=REMOTE_PREFILL_ONLY,
        component_env={
            "prefill-0": {
                "PDSERVE_KV_STREAM_LAYERS": "1",
                "PDSERVE_KV_STREAM_LAST_LAYERS": "5",
                "PDSERVE_MAX_NUM_BATCHED_TOKENS": "64",
                "PDSERVE_MAX_NUM_SEQS": "8",
            },
            "prefill-1": {"PDSERVE_KV_STREAM_LAYERS": "0"},
        },
        log_dir=str(tmp_path_factory.mktemp("streaming-logs")),
        start_timeout_s=300,
    )
    with LocalCluster(spec) as c:
        yield c


def run(cluster, ids: list[int]):
    tokens, text, final = [], "", None
    for r in generate(
        cluster.router_address, token_ids=ids, max_tokens=NEW_TOKENS, temperature=0.0, timeout=120
    ):
        for d in r.deltas:
            tokens.extend(d.token_ids)
            text += d.text
        if r.HasField("final"):
            final = r.final
    return tokens, text, final


def decode_counters(cluster) -> dict[str, int]:
    info = next(n for n in nodes(cluster).values() if n.role is NodeRole.DECODE)
    return {
        "bytes": info.kv_transfer_bytes,
        "transfers": info.kv_transfers,
        "mismatches": info.kv_checksum_mismatches,
        "failures": info.kv_transfer_failures,
        "late": info.kv_late_transfers,
    }


def settled_counters(cluster, since_ms: int) -> dict[str, int]:
    """The decode node's counters from a heartbeat newer than ``since_ms``."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        info = next(n for n in nodes(cluster).values() if n.role is NodeRole.DECODE)
        if info.updated_ms > since_ms:
            return decode_counters(cluster)
        time.sleep(0.05)
    raise AssertionError("no fresh heartbeat from the decode node")


def block_bytes(demo_model_dir) -> int:
    from engine.models.config import ModelArchConfig

    cfg = ModelArchConfig.from_dir(str(demo_model_dir))
    return 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32


def only(cluster, prefill: str | None):
    """Drain every prefill node but ``prefill`` (None: undrain them all)."""
    for other in LAYERS:
        set_drained(cluster, other, prefill is not None and other != prefill)


@pytest.mark.parametrize("prefill", sorted(LAYERS))
def test_streamed_text_equals_hf_transformers(
    cluster, hf_demo, demo_tokenizer, demo_model_dir, prefill
):
    tokenizer = demo_tokenizer
    only(cluster, prefill)
    try:
        before = decode_counters(cluster)
        total_blocks = 0
        for text in PROMPTS:
            ids = tokenizer.encode(f"[{prefill}] {text}")  # new to the decode node's cache
            total_blocks += -(-len(ids) // BLOCK)
            tokens, out_text, final = run(cluster, ids)
            expected = hf_greedy_ids(hf_demo, ids, NEW_TOKENS)
            assert tokens == expected, text
            assert out_text == tokenizer.decode(expected, skip_special_tokens=True)
            assert final.usage.prefill_node == prefill
        wait_idle(cluster, timeout_s=10)
        after = settled_counters(cluster, int(time.time() * 1000))
    finally:
        only(cluster, None)
    assert after["transfers"] - before["transfers"] == len(PROMPTS)
    # Every block of every prompt crossed (each prompt is new to the decode
    # node), each chunk checksummed on both sides.
    assert after["bytes"] - before["bytes"] == total_blocks * block_bytes(demo_model_dir)
    assert after["mismatches"] == after["failures"] == after["late"] == 0


def test_prefix_hits_stream_only_the_blocks_from_the_first_uncached_one(
    cluster, hf_demo, demo_tokenizer, demo_model_dir
):
    tokenizer = demo_tokenizer
    prefix = tokenizer.encode(
        "You are a helpful assistant for the city library. Opening hours, fees and "
        "the rules for borrowing books are as follows. " * 4
    )
    assert len(prefix) > 4 * BLOCK
    first = prefix + tokenizer.encode(" Question: when does it open?")
    second = prefix + tokenizer.encode(" Question: what does a card cost?")
    only(cluster, "prefill-0")
    try:
        tokens, _, _ = run(cluster, first)
        assert tokens == hf_greedy_ids(hf_demo, first, NEW_TOKENS)
        wait_idle(cluster, timeout_s=10)
        before = settled_counters(cluster, int(time.time() * 1000))
        tokens, _, final = run(cluster, second)
        wait_idle(cluster, timeout_s=10)
        after = settled_counters(cluster, int(time.time() * 1000))
    finally:
        only(cluster, None)
    assert tokens == hf_greedy_ids(hf_demo, second, NEW_TOKENS)
    # The decode node had the shared prefix's full blocks: only the rest crossed.
    sent_blocks = -(-len(second) // BLOCK) - len(prefix) // BLOCK
    assert after["bytes"] - before["bytes"] == sent_blocks * block_bytes(demo_model_dir)
    # The prefill node served the prefix from its own cache too.
    assert final.usage.cached_tokens >= len(prefix) // BLOCK * BLOCK
    assert after["mismatches"] == after["failures"] == 0


@pytest.mark.parametrize("flag", ["--kv-stream-layers", "--kv-stream-last-layers"])
def test_bad_stream_layers_flag_is_refused(demo_model_dir, flag):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "prefill", "--model", str(demo_model_dir), flag, "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert flag in proc.stderr and "must be >= 0" in proc.stderr
