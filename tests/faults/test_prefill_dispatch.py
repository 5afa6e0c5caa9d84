"""The Prefill from the router (``--prefill-dispatch router``; router/dispatch.py),
through a real cluster: real processes, a real Redis, KV over gloo, HF
transformers the oracle.

Two prefill nodes and one decode node, all of one rank, no ``--verify-kv``.
The router sends each disaggregated request's Prefill to the prefill node
itself, beside the request to the decode node, once the pair served a request
the decode node's way (so the first request of each pair here is a warm-up).
prefill-0 streams the last 5 layers one by one and prefills in 64-token
chunks (a long prompt streams step by step); prefill-1 holds each request's
last group of KV segments half-way (one chunk out) for TRANSFER_PAUSE_S
seconds, a window in which to kill it with a stream on the wire.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest

from pdserve.launcher import LocalCluster
from tests.conftest import REMOTE_PREFILL_ONLY, hf_greedy_ids
from tests.faults.harness import (
    Stream,
    assert_idle,
    component,
    nodes,
    request,
    run,
    set_drained,
    spec,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)

TRANSFER_PAUSE_S = 2.0
LEASE_S = 5.0
TRANSFER_TIMEOUT_S = 5.0
TTL_S = 3.0
TOKENS = 12
BLOCK = 16
PREFILLS = ("prefill-0", "prefill-1")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    # Over 64 tokens: prefilled in several chunks on prefill-0.
    "Summarize the following notes. " + "The river rose after three days of rain. " * 12,
]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("dispatch-logs"),
        num_prefill=2,
        num_decode=1,
        node_args=["--node-ttl", str(TTL_S)],
        router_args=[*REMOTE_PREFILL_ONLY, "--no-migration", "--prefill-dispatch", "router"],
        component_env={
            "prefill-0": {
                "PDSERVE_KV_STREAM_LAST_LAYERS": "5",
                "PDSERVE_MAX_NUM_BATCHED_TOKENS": "64",
                "PDSERVE_MAX_NUM_SEQS": "8",
            },
            "prefill-1": {"PDSERVE_FAULT_DELAYS": f"transfer_mid={TRANSFER_PAUSE_S}"},
            "decode-0": {
                "PDSERVE_KV_LEASE_S": str(LEASE_S),
                # A reservation expected with no end header to come would fail
                # the idle channel this long after (the last test waits for it).
                "PDSERVE_TRANSFER_TIMEOUT_S": str(TRANSFER_TIMEOUT_S),
            },
        },
    )
    with LocalCluster(s) as c:
        yield c


def only(cluster, prefill: str | None) -> None:
    """Drain every prefill node but ``prefill`` (None: undrain them all)."""
    for other in PREFILLS:
        set_drained(cluster, other, prefill is not None and other != prefill)


def decode_counter(cluster, name: str) -> int:
    return getattr(nodes(cluster)["decode-0"], name)


def settled(cluster, name: str) -> int:
    """The decode node's counter from a heartbeat newer than this call."""
    since_ms = int(time.time() * 1000)
    wait_for(lambda: nodes(cluster)["decode-0"].updated_ms > since_ms, 5, "a fresh heartbeat")
    return decode_counter(cluster, name)


def served(cluster, ids: list[int], prefill: str):
    """A greedy request on ``ids``: its outcome, which must be OK on ``prefill``."""
    outcome = run(cluster.router_address, request(token_ids=ids, max_tokens=TOKENS), timeout=120)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.final.usage.prefill_node == prefill
    return outcome


def warm(cluster, demo_tokenizer, prefill: str) -> None:
    """Requests until the pair (``prefill``, decode-0) took one the router's way."""
    before = settled(cluster, "dispatched_prefills")

    def dispatched():
        served(cluster, demo_tokenizer.encode(f"[{prefill}] {time.time()} warm up"), prefill)
        return settled(cluster, "dispatched_prefills") > before

    wait_for(dispatched, 60, f"a request through {prefill} with the router's Prefill", 0.1)


def test_text_equals_hf_transformers_with_the_prefill_from_the_router(
    cluster, hf_demo, demo_tokenizer
):
    only(cluster, "prefill-0")
    try:
        warm(cluster, demo_tokenizer, "prefill-0")
        dispatched = settled(cluster, "dispatched_prefills")
        first_tokens = settled(cluster, "kv_first_tokens")
        for text in PROMPTS:
            ids = demo_tokenizer.encode(f"[dispatch] {text}")  # new to both caches
            outcome = served(cluster, ids, "prefill-0")
            expected = hf_greedy_ids(hf_demo, ids, TOKENS)
            assert outcome.token_ids == expected, text
            assert outcome.text == demo_tokenizer.decode(expected, skip_special_tokens=True)
            timing = outcome.final.usage.timing
            # The prefill node's own times came with its reply to the router.
            assert timing.prefill_compute_ms > 0 and timing.prefill_node_ms > 0
            assert timing.decode_admit_ms == 0  # not on the path: the Prefill did not wait for it
        assert_idle(cluster, expect_nodes=3)
    finally:
        only(cluster, None)
    # Every one went the router's way, its first token on the KV channel.
    assert settled(cluster, "dispatched_prefills") - dispatched == len(PROMPTS)
    assert settled(cluster, "kv_first_tokens") - first_tokens == len(PROMPTS)
    assert decode_counter(cluster, "kv_transfer_failures") == 0


def test_prefix_hits_send_only_the_blocks_from_the_first_uncached_one(
    cluster, hf_demo, demo_tokenizer, demo_model_dir
):
    from engine.models.config import ModelArchConfig

    cfg = ModelArchConfig.from_dir(str(demo_model_dir))
    block_bytes = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * 4
    prefix = demo_tokenizer.encode(
        "[dispatch] You are a helpful assistant for the city library. Opening hours, "
        "fees and the rules for borrowing books are as follows. " * 4
    )
    first = prefix + demo_tokenizer.encode(" Question: when does it open?")
    second = prefix + demo_tokenizer.encode(" Question: what does a card cost?")
    only(cluster, "prefill-0")
    try:
        warm(cluster, demo_tokenizer, "prefill-0")
        assert served(cluster, first, "prefill-0").token_ids == hf_greedy_ids(
            hf_demo, first, TOKENS
        )
        assert_idle(cluster)
        before = settled(cluster, "kv_transfer_bytes")
        dispatched = settled(cluster, "dispatched_prefills")
        outcome = served(cluster, second, "prefill-0")
        assert_idle(cluster)
        after = settled(cluster, "kv_transfer_bytes")
    finally:
        only(cluster, None)
    assert outcome.token_ids == hf_greedy_ids(hf_demo, second, TOKENS)
    assert settled(cluster, "dispatched_prefills") - dispatched == 1
    # The decode node had the prefix's full blocks: its blocks command said so.
    sent_blocks = -(-len(second) // BLOCK) - len(prefix) // BLOCK
    assert after - before == sent_blocks * block_bytes
    assert outcome.final.usage.cached_tokens >= len(prefix) // BLOCK * BLOCK


def test_requests_with_logprobs_go_the_decode_nodes_way(cluster, hf_demo, demo_tokenizer):
    ids = demo_tokenizer.encode("[dispatch] Logprobs, please: the colour of the sky is")
    only(cluster, "prefill-0")
    try:
        warm(cluster, demo_tokenizer, "prefill-0")
        dispatched = settled(cluster, "dispatched_prefills")
        req = request(token_ids=ids, max_tokens=TOKENS, logprobs=1)
        outcome = run(cluster.router_address, req, timeout=120)
    finally:
        only(cluster, None)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.final.usage.prefill_node == "prefill-0"
    assert outcome.token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
    # The first token's logprobs come with the reply, which goes to the decode node.
    assert settled(cluster, "dispatched_prefills") == dispatched


def test_a_prefill_node_killed_mid_transfer_is_retried_on_the_other(
    cluster, hf_demo, demo_tokenizer
):
    ids = demo_tokenizer.encode("[dispatch] Tell me about the history of the printing press.")
    expected = hf_greedy_ids(hf_demo, ids, TOKENS)
    only(cluster, "prefill-1")
    try:
        warm(cluster, demo_tokenizer, "prefill-1")
        dispatched = settled(cluster, "dispatched_prefills")
        landed = settled(cluster, "kv_transfer_bytes")
        stream = Stream(cluster.router_address, request(token_ids=ids, max_tokens=TOKENS))
        # Killed mid-stream: its first chunk landed, the rest of its group waits.
        wait_for(
            lambda: decode_counter(cluster, "kv_transfer_bytes") > landed,
            30,
            "a first chunk landed",
            0.02,
        )
        set_drained(cluster, "prefill-0", False)
        victim = component(cluster, "prefill-1")
        victim.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        outcome = stream.result(60)
    finally:
        only(cluster, None)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.final.usage.prefill_node == "prefill-0"  # retried there
    assert outcome.token_ids == expected
    assert outcome.first_at - killed < 5
    assert settled(cluster, "dispatched_prefills") > dispatched  # the killed one went so
    wait_for(lambda: "prefill-1" not in nodes(cluster), TTL_S + 2, "dead node left Redis")
    # Nothing of the dead transfer is left on the decode node.
    assert_idle(cluster, expect_nodes=2)
    cluster.restart(victim)
    wait_for(lambda: "prefill-1" in nodes(cluster), 10, "restarted node registered")
    # The router's session with it opens anew, and its Prefills go from the
    # router again once the pair served a request the decode node's way.
    only(cluster, "prefill-1")
    try:
        warm(cluster, demo_tokenizer, "prefill-1")
    finally:
        only(cluster, None)


def test_a_restarted_decode_nodes_new_channel_gets_the_decode_nodes_prefill(
    cluster, hf_demo, demo_tokenizer
):
    """The router still takes the pair (prefill-0, decode-0) for one that served
    its way, but the restarted decode node's KV channel with prefill-0 is a new
    one, which prefill-0 learns only from a Prefill of the decode node's: it
    refuses the router's at the decode node's blocks (FAILED_PRECONDITION), the
    decode node's request is cancelled, and the router retries the request
    with the decode node's own Prefill."""
    only(cluster, "prefill-0")
    try:
        warm(cluster, demo_tokenizer, "prefill-0")
        victim = component(cluster, "decode-0")
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        cluster.restart(victim)
        wait_for(lambda: nodes(cluster).get("decode-0") is not None, 10, "decode-0 registered")
        # The router's session with the new process opens on a request through
        # prefill-1 (the decode node's way: what it takes is not known yet).
        only(cluster, "prefill-1")
        ids = demo_tokenizer.encode("[dispatch] After the restart, the lighthouse keeper")
        assert served(cluster, ids, "prefill-1").token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
        only(cluster, "prefill-0")
        assert_idle(cluster, expect_nodes=3)
        dispatched = settled(cluster, "dispatched_prefills")
        aborted = settled(cluster, "aborted_prefill")
        ids = demo_tokenizer.encode("[dispatch] and then the keeper climbed the stairs to")
        outcome = served(cluster, ids, "prefill-0")
        assert outcome.token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
        assert_idle(cluster, expect_nodes=3)
        # The router's Prefill was refused, its request on the decode node
        # cancelled before anything was sent, and the retry went the decode
        # node's way (not counted): one each.
        assert settled(cluster, "dispatched_prefills") - dispatched == 1
        assert settled(cluster, "aborted_prefill") - aborted == 1
        # The refused Prefill's stream ended on the decode node's channel (the
        # prefill node sent its end header there): nothing lingers to fail the
        # idle channel a transfer timeout later.
        failures = channel_failures(cluster)
        time.sleep(TRANSFER_TIMEOUT_S + 2)
        assert channel_failures(cluster) == failures
        # From then on the pair goes the router's way again.
        warm(cluster, demo_tokenizer, "prefill-0")
    finally:
        only(cluster, None)


def channel_failures(cluster) -> int:
    """KV channel failures decode-0 logged (its log spans its restarts)."""
    log = Path(cluster.spec.log_dir) / "decode-0.log"
    return log.read_text(errors="replace").count("KV channel from prefill-0")
