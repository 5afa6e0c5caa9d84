"""KV channels built while the host is loaded and the prefill node is busy
(issue 50, item 9): real processes, CPU-burning processes beside them.

One prefill node and two decode nodes, round-robin routing (each request's
decode node is known in advance), a short transfer timeout, and a prefill
node whose engine rests ``BUSY_S`` after every step: a Prefill that comes
meanwhile waits that long before its KV starts. A prefill node that is slow
to start a prompt is not a failed channel; the KV lease bounds that wait, not
the transfer or connect timeout:

* A goes through decode-0 (its channel is built at once: the prefill node is idle);
* B, sent once A's first token is out, through decode-1: a channel built
  while the prefill node rests, so its sender comes ``BUSY_S`` after the
  decode node asked for it;
* C, sent once B's first token is out, through decode-0 again: a channel in
  place whose next KV comes ``BUSY_S`` after the decode node expected it.

Each must be served by prefill-0 on its first attempt, with no KV channel
failing on either side.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import grpc
import pytest

from pdserve.launcher import LocalCluster
from pdserve.threads import usable_cores
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.faults.harness import Stream, assert_idle, counters, request, spec

pytestmark = pytest.mark.timeout(600)

BUSY_S = 6.0
TRANSFER_TIMEOUT_S = 3.0
PROMPTS = [
    "Describe a lighthouse at dusk. " * 6,
    "List the planets of the solar system with one fact each. " * 4,
    "Write a recipe for bread, step by step. " * 5,
]


def _burn() -> None:
    while True:
        pass


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("kv-load-logs"),
        num_prefill=1,
        num_decode=2,
        node_args=["--transfer-timeout", str(TRANSFER_TIMEOUT_S)],
        router_args=["--routing-policy", "round-robin", *REMOTE_PREFILL_ONLY],
        component_env={"prefill-0": {"PDSERVE_FAULT_DELAYS": f"prefill_step={BUSY_S}"}},
    )
    with LocalCluster(s) as c:
        yield c


@pytest.fixture
def loaded_host():
    """One busy process per core, as another workload on the host would be."""
    ctx = mp.get_context("spawn")
    burners = [ctx.Process(target=_burn, daemon=True) for _ in range(usable_cores())]
    for p in burners:
        p.start()
    yield
    for p in burners:
        p.terminate()
    for p in burners:
        p.join(10)


def test_channels_built_while_the_prefill_node_is_busy_serve_the_first_attempt(
    cluster, loaded_host
):
    names = ("kv_transfer_failures", "kv_transfers")
    before = counters(cluster, *names)
    outcomes = []
    sent = []
    for prompt in PROMPTS:
        sent.append(time.monotonic())
        stream = Stream(cluster.router_address, request(prompt, max_tokens=4), timeout=120)
        assert stream.first.wait(120), "no first token within 120 s"
        outcomes.append(stream.result(120))
    after = counters(cluster, *names)
    for name, outcome, start in zip("ABC", outcomes, sent, strict=True):
        assert outcome.code is grpc.StatusCode.OK, f"{name}: {outcome.details}"
        usage = outcome.final.usage
        ttft = outcome.first_at - start
        print(f"{name}: decode {usage.decode_node}, prefill {usage.prefill_node!r}, {ttft:.1f} s")
        assert usage.prefill_node == "prefill-0", f"{name} was retried ({ttft:.1f} s)"
    assert [o.final.usage.decode_node for o in outcomes] == ["decode-0", "decode-1", "decode-0"]
    for node in ("decode-0", "decode-1", "prefill-0"):
        assert after[node]["kv_transfer_failures"] == before[node]["kv_transfer_failures"], node
    assert after["prefill-0"]["kv_transfers"] - before["prefill-0"]["kv_transfers"] == 3
    logs = Path(cluster.spec.log_dir)
    for node in ("decode-0", "decode-1", "prefill-0"):
        text = (logs / f"{node}.log").read_text()
        assert "KV channel from" not in text and "KV transfer to" not in text, node
    assert_idle(cluster, expect_nodes=3)
