"""A decode node's return is noticed at once (issue 50, item 6), through
`pdserve up` with one prefill node and one decode node: nothing else can
serve while decode-0 is down.

* A stream on decode-0 survives its SIGKILL: the router waits (for up to
  --migration-wait) for a decode node to take the stream, the supervisor
  restarts decode-0, and the stream continues there with the very tokens an
  undisturbed run gives.
* The first request after the restarted decode-0 serves succeeds, although
  requests sent while it was down failed (putting decode-0 in the router's
  failure cool-down, and its connection in reconnect backoff): the router
  forgets both once the new process registers.

Every Prefill goes to the prefill node (PDSERVE_LOCAL_PREFILL_MAX_TOKENS=0),
so the restarted decode node's KV channel is part of what must work at once.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import grpc
import pytest

from common.grpc_server import health_check
from pdserve.redis_server import free_port
from tests.faults.harness import Stream, request, run, wait_for
from tests.pdserve_up import SERVING_LINE, UpProcess

pytestmark = pytest.mark.timeout(900)

PROMPT = "Write a short story about a cat who learns to sail across a lake."
TOKENS = 60
# A restart on a loaded 2-core host (load the model, register) takes tens of seconds.
MIGRATION_WAIT_S = 180


@pytest.fixture(scope="module")
def up(demo_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("decode-restart-logs")
    args = ["--model", str(demo_model_dir), "--prefill", "1", "--decode", "1"]
    args += ["--port", str(free_port()), "--admin-port", str(free_port())]
    args += ["--metrics-port", "0", "--max-model-len", "1024", "--log-dir", str(logs)]
    args += ["--migration-wait", str(MIGRATION_WAIT_S)]
    env = {
        "PDSERVE_HEARTBEAT_S": "0.1",
        "PDSERVE_DRAIN_TIMEOUT_S": "5",
        "PDSERVE_NUM_KVCACHE_BLOCKS": "256",
        "PDSERVE_LOCAL_PREFILL_MAX_TOKENS": "0",
        # The router's cool-down for a node whose call failed, longer than a
        # restart takes here: as on a host that restarts a node within the
        # default 5 s, the node is back while the cool-down still runs.
        "PDSERVE_FAILURE_COOLDOWN_S": "120",
    }
    cluster = UpProcess(args, env)
    cluster.wait_ready()
    cluster.logs = logs
    yield cluster
    assert cluster.stop() == 0, cluster.output()


def decode_address(up: UpProcess) -> str:
    return next(m.group(2) for m in up.matches(SERVING_LINE) if m.group(1) == "decode-0")


def wait_back(up: UpProcess, pid: int, mark: int) -> re.Match:
    """Until the supervisor says decode-0 serves again: its line, with the new pid."""
    line = up.wait_line(r"^decode-0 serving again on \S+ \(pid (\d+)\)$", 300, mark)
    assert int(line.group(1)) != pid and int(line.group(1)) == up.pids()["decode-0"]
    return line


def served(up: UpProcess, prompt: str) -> bool:
    return run(up.router, request(prompt, max_tokens=4), timeout=60).code is grpc.StatusCode.OK


def test_a_stream_on_the_only_decode_node_survives_its_sigkill(up):
    reference = run(up.router, request(PROMPT, max_tokens=TOKENS, ignore_eos=True))
    assert reference.code is grpc.StatusCode.OK, reference.details
    stream = Stream(up.router, request(PROMPT, max_tokens=TOKENS, ignore_eos=True), timeout=600)
    wait_for(lambda: len(stream.outcome.token_ids) >= 10, 120, "10 tokens at the client")
    assert not stream.done.is_set()
    mark = len(up.lines)
    pid = up.signal("decode-0", signal.SIGKILL)
    outcome = stream.result(600)
    assert outcome.code is grpc.StatusCode.OK, outcome.details
    assert outcome.token_ids == reference.token_ids
    assert outcome.text == reference.text
    wait_back(up, pid, mark)
    log = (up.logs / "router.log").read_text()
    assert re.search(r"no decode node can take the stream now .*; waiting up to", log), log
    assert re.search(r"decode node decode-0 takes the stream after \d+\.\d s", log), log


def test_the_first_request_after_a_decode_node_returns_succeeds(up):
    address = decode_address(up)
    wait_for(lambda: served(up, "Hello there"), 300, "a request served", interval_s=1)
    mark = len(up.lines)
    pid = up.signal("decode-0", signal.SIGKILL)
    # Requests while it is down fail (nothing else can serve them), as a
    # client's did: the router marks decode-0 failed and its connection to
    # decode-0's address backs off after each refused connect.
    codes: list[grpc.StatusCode] = []
    back = threading.Event()

    def knock() -> None:
        while not back.is_set():
            codes.append(run(up.router, request("Anyone there?", max_tokens=2), timeout=20).code)
            time.sleep(0.1)

    knocking = threading.Thread(target=knock, daemon=True)
    knocking.start()
    # Serving as the supervisor sees it (its health check), the moment its line is printed.
    wait_for(lambda: health_check(address, timeout=0.5), 300, "decode-0 serving", 0.02)
    back.set()
    knocking.join(30)
    first = run(up.router, request("Hello again", max_tokens=4), timeout=60)
    print(f"while down: {len(codes)} requests; the first after: {first.code.name} {first.details}")
    assert first.code is grpc.StatusCode.OK, first.details
    assert grpc.StatusCode.UNAVAILABLE in codes, codes  # the outage was real
    wait_back(up, pid, mark)
