"""KV exhaustion on a decode node: preemption by recompute leaves outputs
unchanged (real processes; every prompt prefilled remotely and its KV sent).

The decode node has 20 blocks of 16 tokens. Eight concurrent greedy requests
of ~15 prompt + 40 output tokens need about 32: the node must preempt running
sequences (their blocks freed, their tokens recomputed later on the decode
node itself) and still produce, token for token, what each request produces
with blocks to spare (four at a time, about 16 blocks: no preemption).
"""

from __future__ import annotations

import grpc
import pytest

from pdserve.launcher import LocalCluster
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.faults.harness import Stream, assert_idle, counters, request, spec

pytestmark = pytest.mark.timeout(900)

NUM_BLOCKS = 20
MAX_TOKENS = 40
UNPRESSURED = 4  # requests at a time that fit with room to spare
PROMPTS = [
    f"Request {i}: describe the colour {c} in one long sentence."
    for i, c in enumerate(["red", "blue", "green", "yellow", "purple", "orange", "black", "white"])
]


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("kv-exhaustion-logs"),
        num_prefill=1,
        num_decode=1,
        engine_args=["--num-kvcache-blocks", str(NUM_BLOCKS), "--max-model-len", "256"],
        router_args=[*REMOTE_PREFILL_ONLY, "--max-model-len", "256"],
    )
    with LocalCluster(s) as c:
        yield c


def test_preemption_under_kv_pressure_keeps_greedy_outputs_identical(cluster):
    def req(prompt):
        return request(prompt, max_tokens=MAX_TOKENS, ignore_eos=True)

    def preemptions() -> int:
        return counters(cluster, "preemptions")["decode-0"]["preemptions"]

    start = preemptions()
    unpressured = []
    for i in range(0, len(PROMPTS), UNPRESSURED):  # a few at a time: never short of blocks
        group = [Stream(cluster.router_address, req(p)) for p in PROMPTS[i : i + UNPRESSURED]]
        for o in (s.result(600) for s in group):
            assert o.code is grpc.StatusCode.OK, o.details
            unpressured.append(o.token_ids)
    before = preemptions()
    assert before == start, "the unpressured reference runs were preempted"

    streams = [Stream(cluster.router_address, req(p)) for p in PROMPTS]
    together = [s.result(600) for s in streams]
    for i, o in enumerate(together):
        assert o.code is grpc.StatusCode.OK, (i, o.code, o.details)
        assert o.final.usage.prefill_node == "prefill-0"
        assert o.token_ids == unpressured[i], f"request {i} changed under KV pressure"
    assert_idle(cluster, expect_nodes=2)
    preempted = preemptions() - before
    assert preempted > 0, "the decode node never ran short of blocks: the test proves nothing"
    print(f"{preempted} preemptions; all {len(PROMPTS)} outputs identical to unpressured runs")
