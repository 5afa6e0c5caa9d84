"""The first token on the KV channel, before the Prefill's reply (real processes,
a real Redis, KV over gloo).

One prefill node and one decode node, both of one rank, no ``--verify-kv``:
the decode node asks for each prompt's first token on the KV channel
(``PrefillRequest.first_token_on_kv``), and the prefill node holds every reply
for REPLY_HOLD_S (``PDSERVE_FAULT_DELAYS=prefill_reply=...``), so that the
token on the channel always comes first. The decode node then streams tokens
long before the reply, and the Final waits for the reply (it reports the
Prefill's timings). A prefill node killed while its reply is held leaves the
stream whole: the KV and the first token had all come.
"""

from __future__ import annotations

import signal
import time

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
    spec,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)

REPLY_HOLD_S = 3.0
TTL_S = 3.0
TOKENS = 8


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("first-token-logs"),
        num_prefill=1,
        num_decode=1,
        node_args=["--node-ttl", str(TTL_S)],
        router_args=[*REMOTE_PREFILL_ONLY, "--no-migration"],
        component_env={"prefill-0": {"PDSERVE_FAULT_DELAYS": f"prefill_reply={REPLY_HOLD_S}"}},
    )
    with LocalCluster(s) as c:
        yield c


def decode_counters(cluster) -> tuple[int, int]:
    info = nodes(cluster)["decode-0"]
    return info.kv_first_tokens, info.decoded_before_reply


def ids_of(demo_tokenizer, text: str) -> list[int]:
    return demo_tokenizer.encode(text)


def test_decoding_starts_before_the_reply_and_the_final_waits_for_it(
    cluster, hf_demo, demo_tokenizer
):
    ids = ids_of(demo_tokenizer, "A short history of the lighthouse keepers of the north coast:")
    before = decode_counters(cluster)
    started = time.monotonic()
    outcome = Stream(
        cluster.router_address, request(token_ids=ids, max_tokens=TOKENS), timeout=60
    ).result(70)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
    # Every token streamed while the reply was held; the Final came after it,
    # with the prefill node's own time (the hold included).
    assert outcome.first_at - started < REPLY_HOLD_S
    assert outcome.ended_at - started >= REPLY_HOLD_S
    timing = outcome.final.usage.timing
    assert timing.prefill_node_ms >= REPLY_HOLD_S * 1e3
    assert timing.prefill_compute_ms > 0
    assert timing.prefill_call_ms < REPLY_HOLD_S * 1e3  # sent -> first token in hand
    wait_for(
        lambda: decode_counters(cluster) == (before[0] + 1, before[1] + 1),
        5,
        "the decode node counted one token on the channel, decoded before the reply",
    )
    assert_idle(cluster, expect_nodes=2)


def test_a_prefill_node_killed_after_the_first_token_leaves_the_stream_whole(
    cluster, hf_demo, demo_tokenizer
):
    ids = ids_of(demo_tokenizer, "Ten things to pack for a week of hiking in the mountains:")
    stream = Stream(cluster.router_address, request(token_ids=ids, max_tokens=TOKENS), timeout=60)
    assert stream.first.wait(REPLY_HOLD_S), "no first token while the reply was held"
    # Its reply is still held: the prefill node dies with it.
    component(cluster, "prefill-0").process.send_signal(signal.SIGKILL)
    outcome = stream.result(30)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.token_ids == hf_greedy_ids(hf_demo, ids, TOKENS)
    assert outcome.ended_at - outcome.first_at < REPLY_HOLD_S  # not held for a reply
    # No reply: the Prefill's own times are unknown, and not made up.
    assert outcome.final.usage.prefill_node == "prefill-0"
    assert outcome.final.usage.timing.prefill_node_ms == 0
    wait_for(lambda: "prefill-0" not in nodes(cluster), TTL_S + 3, "the dead node left Redis")
    assert_idle(cluster, expect_nodes=1)
