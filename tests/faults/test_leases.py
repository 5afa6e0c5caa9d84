"""Leases on decode-node reservations, with a short lease (real processes).

The prefill node holds every request's last group of KV segments half-way
(headers and the first chunk out, the other chunks PAUSE_S later), so each
reservation outlives its lease in the middle of its stream: part of its KV has
landed, the decode node reclaims it, the router retries (here: on the decode
node itself, the only prefill node being at fault), and the rest of the stream
arrives while the retried request decodes in the very blocks the reservation
had. Those late chunks must be dropped (the reservation id is the blocks'
generation: never reused), so the output is exactly the offline engine's on
the same prompt.
"""

from __future__ import annotations

import time

import grpc
import pytest

from engine import LLM, SamplingParams
from pdserve.launcher import LocalCluster
from tests.faults.harness import Stream, assert_idle, counters, request, set_drained, spec

pytestmark = pytest.mark.timeout(600)

STORY = "a short story about a lighthouse keeper who finds a message in a bottle. "
MAX_TOKENS = 100
# The prompt (~60 tokens: 4 blocks) plus its output take 10 of the 12 blocks:
# the retried request must reuse blocks of the reclaimed reservation.
NUM_BLOCKS = 12
LEASE_S = 1.5
PAUSE_S = 2.0


# Each prefill node streams its KV its own way: every layer (the default), or
# the last 4 only, where the first chunk, the one that lands before the pause,
# holds the layers before them. One cluster serves both cases, the other
# prefill node drained.
LAST_LAYERS = {"prefill-0": 0, "prefill-1": 4}


@pytest.fixture(scope="module")
def prompt_ids(demo_model_dir):
    """Per prefill node, a prompt of its own (no block in common, so neither
    case finds the other's blocks cached on the decode node) and the offline
    engine's output."""
    llm = LLM(str(demo_model_dir), device="cpu", max_model_len=1024)
    prompts = {
        name: (f"{verb} {STORY}" * 3)
        for name, verb in zip(LAST_LAYERS, ("Write", "Tell"), strict=True)
    }
    ids = {name: llm.llm_engine.tokenizer.encode(p) for name, p in prompts.items()}
    outs = llm.generate(
        [{"prompt_token_ids": i} for i in ids.values()],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    return {
        name: (ids[name], list(o.outputs[0].token_ids)) for name, o in zip(ids, outs, strict=True)
    }


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    delays = {"PDSERVE_FAULT_DELAYS": f"transfer_mid={PAUSE_S}"}
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("lease-logs"),
        num_prefill=2,
        num_decode=1,
        engine_args=["--num-kvcache-blocks", str(NUM_BLOCKS), "--max-model-len", "192"],
        router_args=["--local-prefill-max-tokens", "0", "--max-model-len", "192"],
        component_env={
            **{
                name: {**delays, "PDSERVE_KV_STREAM_LAST_LAYERS": str(last)}
                for name, last in LAST_LAYERS.items()
            },
            "decode-0": {"PDSERVE_KV_LEASE_S": str(LEASE_S)},
        },
    )
    with LocalCluster(s) as c:
        yield c


@pytest.mark.parametrize("prefill", LAST_LAYERS, ids=["every-layer", "last-4-layers"])
def test_a_lease_expiring_mid_stream_reclaims_and_drops_the_late_chunks(
    cluster, prompt_ids, prefill
):
    for name in LAST_LAYERS:  # the router may only choose `prefill`
        set_drained(cluster, name, name != prefill)
    ids, expected = prompt_ids[prefill]
    names = ("leases_expired", "kv_late_transfers", "kv_transfers", "kv_transfer_bytes")
    before = counters(cluster, *names)["decode-0"]
    stream = Stream(
        cluster.router_address, request(token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    # Watch for the late payload's drop while the retried request still decodes
    # (published with the next heartbeat, so if seen before the end, it was
    # dropped before the end).
    dropped_at = None
    while not stream.done.is_set():
        late = counters(cluster, "kv_late_transfers")["decode-0"]["kv_late_transfers"]
        if dropped_at is None and late > before["kv_late_transfers"]:
            dropped_at = time.monotonic()
        time.sleep(0.02)
    outcome = stream.result(120)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    # Retried after the lease: prefilled on the decode node, the prefill node avoided.
    assert outcome.final.usage.prefill_node == ""
    assert dropped_at is not None and dropped_at < outcome.ended_at, (
        "the late payload was not seen dropped while the retried request decoded"
    )
    assert outcome.token_ids == expected
    assert_idle(cluster, expect_nodes=3)
    after = counters(cluster, *names)["decode-0"]
    assert after["leases_expired"] - before["leases_expired"] == 1
    assert after["kv_late_transfers"] - before["kv_late_transfers"] == 1
    # Mid-stream: its first chunk had landed, the rest never did.
    assert after["kv_transfers"] == before["kv_transfers"]
    assert after["kv_transfer_bytes"] > before["kv_transfer_bytes"]
