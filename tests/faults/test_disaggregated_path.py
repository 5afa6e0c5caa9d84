"""The one disaggregated path through a real cluster: real processes, a real
Redis, KV over gloo, HF transformers the oracle.

Two prefill nodes and one decode node, no ``--verify-kv``. The router sends
each disaggregated request's Prefill to the prefill node itself, beside the
request to the decode node; the decode node's blocks and KV channel go to the
prefill node on its own session, and the first token comes on the KV channel
behind the prompt's KV. Nothing needs a warm-up: the first request to a pair,
and the first after a restart, take the same path as every other.

prefill-0 streams the last 5 layers one by one and prefills in 64-token
chunks (a long prompt streams step by step), and holds every reply for
REPLY_HOLD_S: nothing may wait for it. prefill-1 holds each request's last
group of KV segments half-way (one chunk out) for TRANSFER_PAUSE_S seconds, a
window in which to kill it with a stream on the wire.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest
import torch

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
# Well above a loaded CI machine's request time: a stream that waited for its
# reply would take at least this long.
REPLY_HOLD_S = 8.0
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
        tmp_path_factory.mktemp("disaggregated-logs"),
        num_prefill=2,
        num_decode=1,
        node_args=["--node-ttl", str(TTL_S)],
        router_args=[*REMOTE_PREFILL_ONLY, "--no-migration"],
        component_env={
            "prefill-0": {
                "PDSERVE_KV_STREAM_LAST_LAYERS": "5",
                "PDSERVE_MAX_NUM_BATCHED_TOKENS": "64",
                "PDSERVE_MAX_NUM_SEQS": "8",
                "PDSERVE_FAULT_DELAYS": f"prefill_reply={REPLY_HOLD_S}",
            },
            "prefill-1": {"PDSERVE_FAULT_DELAYS": f"transfer_mid={TRANSFER_PAUSE_S}"},
            "decode-0": {
                "PDSERVE_KV_LEASE_S": str(LEASE_S),
                # A reservation expected with no end header to come would fail
                # the idle channel this long after (the restart test waits for it).
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


def served(cluster, ids: list[int], prefill: str, **kwargs):
    """A greedy request on ``ids``: its outcome, which must be OK on ``prefill``."""
    req = request(token_ids=ids, max_tokens=TOKENS, **kwargs)
    outcome = run(cluster.router_address, req, timeout=120)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.final.usage.prefill_node == prefill
    return outcome


def test_text_equals_hf_transformers_and_nothing_waits_for_the_reply(
    cluster, hf_demo, demo_tokenizer
):
    only(cluster, "prefill-0")
    try:
        landed = settled(cluster, "kv_transfers")
        for text in PROMPTS:
            ids = demo_tokenizer.encode(f"[one path] {text}")  # new to both caches
            started = time.monotonic()
            outcome = served(cluster, ids, "prefill-0")
            expected = hf_greedy_ids(hf_demo, ids, TOKENS)
            assert outcome.token_ids == expected, text
            assert outcome.text == demo_tokenizer.decode(expected, skip_special_tokens=True)
            # Every reply is held: the stream ended without it, and no figure of
            # the prefill node's was made up.
            assert outcome.ended_at - started < REPLY_HOLD_S
            timing = outcome.final.usage.timing
            assert timing.prefill_node_ms == timing.prefill_compute_ms == 0
            # The decode node's own part: its admission, the wait for the KV.
            assert timing.decode_admit_ms > 0 and timing.kv_wait_ms > 0
        assert_idle(cluster, expect_nodes=3)
    finally:
        only(cluster, None)
    assert settled(cluster, "kv_transfers") - landed == len(PROMPTS)
    assert decode_counter(cluster, "kv_transfer_failures") == 0


def test_prefix_hits_send_only_the_blocks_from_the_first_uncached_one(
    cluster, hf_demo, demo_tokenizer, demo_model_dir
):
    from engine.models.config import ModelArchConfig

    cfg = ModelArchConfig.from_dir(str(demo_model_dir))
    block_bytes = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * 4
    prefix = demo_tokenizer.encode(
        "[one path] You are a helpful assistant for the city library. Opening hours, "
        "fees and the rules for borrowing books are as follows. " * 4
    )
    first = prefix + demo_tokenizer.encode(" Question: when does it open?")
    second = prefix + demo_tokenizer.encode(" Question: what does a card cost?")
    only(cluster, "prefill-0")
    try:
        assert served(cluster, first, "prefill-0").token_ids == hf_greedy_ids(
            hf_demo, first, TOKENS
        )
        assert_idle(cluster)
        before = settled(cluster, "kv_transfer_bytes")
        outcome = served(cluster, second, "prefill-0")
        assert_idle(cluster)
        after = settled(cluster, "kv_transfer_bytes")
    finally:
        only(cluster, None)
    assert outcome.token_ids == hf_greedy_ids(hf_demo, second, TOKENS)
    # The decode node had the prefix's full blocks: its blocks command said so.
    sent_blocks = -(-len(second) // BLOCK) - len(prefix) // BLOCK
    assert after - before == sent_blocks * block_bytes
    assert outcome.final.usage.cached_tokens >= len(prefix) // BLOCK * BLOCK


def test_the_first_tokens_logprobs_come_on_the_kv_channel_equal_to_hf(
    cluster, hf_demo, demo_tokenizer
):
    ids = demo_tokenizer.encode("[one path] Logprobs, please: the colour of the sky is")
    only(cluster, "prefill-0")
    try:
        outcome = served(cluster, ids, "prefill-0", logprobs=3)
    finally:
        only(cluster, None)
    assert outcome.token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
    first = outcome.logprobs[0]
    with torch.no_grad():
        logits = hf_demo(torch.tensor([ids])).logits[0, -1].float()
    expected = torch.log_softmax(logits, dim=-1)
    best = expected.topk(3)
    assert first.token_id == outcome.token_ids[0] and first.rank == 1
    assert first.logprob == pytest.approx(expected[first.token_id].item(), abs=1e-3)
    assert [t.token_id for t in first.top] == best.indices.tolist()
    assert [t.logprob for t in first.top] == pytest.approx(best.values.tolist(), abs=1e-3)
    assert len(outcome.logprobs) == TOKENS


def test_a_prefill_node_killed_after_the_first_token_leaves_the_stream_whole(
    cluster, hf_demo, demo_tokenizer
):
    ids = demo_tokenizer.encode("[one path] Ten things to pack for a week in the mountains:")
    only(cluster, "prefill-0")
    try:
        stream = Stream(
            cluster.router_address, request(token_ids=ids, max_tokens=TOKENS), timeout=60
        )
        assert stream.first.wait(REPLY_HOLD_S), "no first token while the reply was held"
        # Its reply is still held: the prefill node dies with it.
        victim = component(cluster, "prefill-0")
        victim.process.send_signal(signal.SIGKILL)
        outcome = stream.result(30)
    finally:
        only(cluster, None)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
    assert outcome.final.usage.prefill_node == "prefill-0"
    wait_for(lambda: "prefill-0" not in nodes(cluster), TTL_S + 3, "the dead node left Redis")
    assert_idle(cluster, expect_nodes=2)
    cluster.restart(victim)
    wait_for(lambda: "prefill-0" in nodes(cluster), 30, "restarted node registered")


def test_a_prefill_node_killed_mid_transfer_is_retried_on_the_other(
    cluster, hf_demo, demo_tokenizer
):
    ids = demo_tokenizer.encode("[one path] Tell me about the history of the printing press.")
    expected = hf_greedy_ids(hf_demo, ids, TOKENS)
    only(cluster, "prefill-1")
    try:
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
    wait_for(lambda: "prefill-1" not in nodes(cluster), TTL_S + 2, "dead node left Redis")
    # Nothing of the dead transfer is left on the decode node.
    assert_idle(cluster, expect_nodes=2)
    cluster.restart(victim)
    wait_for(lambda: "prefill-1" in nodes(cluster), 30, "restarted node registered")
    # Its first request after the restart takes the same path, at once.
    only(cluster, "prefill-1")
    try:
        ids = demo_tokenizer.encode("[one path] After the restart, the printer")
        assert served(cluster, ids, "prefill-1").token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
    finally:
        only(cluster, None)


def test_a_restarted_decode_nodes_first_request_takes_its_new_channel(
    cluster, hf_demo, demo_tokenizer
):
    """A restarted decode node names its new KV channel in its first blocks:
    the prefill node joins it at once (no earlier request teaches it), and
    nothing of the old channel lingers to fail the new one later."""
    only(cluster, "prefill-0")
    try:
        ids = demo_tokenizer.encode("[one path] Before the restart, the lighthouse keeper")
        assert served(cluster, ids, "prefill-0").token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
        victim = component(cluster, "decode-0")
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        cluster.restart(victim)
        wait_for(lambda: nodes(cluster).get("decode-0") is not None, 30, "decode-0 registered")
        aborted = settled(cluster, "aborted_prefill")
        ids = demo_tokenizer.encode("[one path] and then the keeper climbed the stairs to")
        outcome = served(cluster, ids, "prefill-0")
        assert outcome.token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
        assert_idle(cluster, expect_nodes=3)
        assert settled(cluster, "aborted_prefill") == aborted  # nothing refused or retried
        failures = channel_failures(cluster)
        time.sleep(TRANSFER_TIMEOUT_S + 2)
        assert channel_failures(cluster) == failures
    finally:
        only(cluster, None)


def channel_failures(cluster) -> int:
    """KV channel failures decode-0 logged (its log spans its restarts)."""
    log = Path(cluster.spec.log_dir) / "decode-0.log"
    return log.read_text(errors="replace").count("KV channel from prefill-0")
