"""Redis faults (real processes, a real Redis): a 30 s outage, then false entries.

During the outage the router serves on the nodes it last saw and the nodes
keep heartbeating with backoff; when Redis comes back (empty: it restarted)
everything re-registers and republishes its cached blocks by itself. False
entries -- a phantom node, block hashes a node does not hold, a node
reporting zero load while busy -- cost time at most, never a request or a
correct token.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest
import redis

from common.cluster.state import DEFAULT_PREFIX, NodeInfo
from engine.block_hash import BlockHasher
from engine.config import EngineConfig
from pdserve.launcher import LocalCluster
from pdserve.redis_server import RedisServer, free_port
from proto import admin_pb2, admin_pb2_grpc
from router.frontend import Frontend
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.faults.harness import (
    Stream,
    assert_idle,
    component,
    nodes,
    request,
    run,
    spec,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)

OUTAGE_S = 30.0
# Long enough to fill blocks: they are cached, published, and republished.
PROMPT = "You are a geography teacher. " * 8 + "What is the tallest mountain in the world?"


@pytest.fixture(scope="module")
def cluster(demo_model_dir, tmp_path_factory):
    s = spec(
        demo_model_dir,
        tmp_path_factory.mktemp("redis-logs"),
        num_prefill=1,
        num_decode=1,
        # A stream whose only decode node stalls fails once it is found, rather
        # than waiting for the node to come back (test_decode_restart.py's case).
        router_args=[*REMOTE_PREFILL_ONLY, "--migration-wait", "0"],
    )
    with LocalCluster(s) as c:
        yield c


def metric(cluster, component_name: str, name: str) -> float:
    url = component(cluster, component_name).metrics_url
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported by {component_name}")


def test_a_30s_outage_keeps_serving_and_recovers_by_itself(cluster):
    expected = run(cluster.router_address, request(PROMPT)).token_ids
    port = cluster.redis.port
    cluster.redis.stop()
    down = time.monotonic()
    served, latencies = 0, []
    try:
        while time.monotonic() - down < OUTAGE_S:
            start = time.monotonic()
            o = run(cluster.router_address, request(PROMPT), timeout=60)
            latencies.append(time.monotonic() - start)
            assert o.code is grpc.StatusCode.OK, (time.monotonic() - down, o.details)
            assert o.token_ids == expected
            assert o.final.usage.prefill_node == "prefill-0"
            served += 1
            time.sleep(1.0)
    finally:
        cluster.redis = RedisServer(port=port).start()  # back, empty
    assert metric(cluster, "router", "pdserve_router_stale_routes_total") >= served
    for name in ("prefill-0", "decode-0"):
        assert component(cluster, name).process.poll() is None
    # Nodes re-register (heartbeat backoff is at most 5 s) and republish their
    # cached blocks, so routing sees the prefix cache again.
    wait_for(lambda: len(nodes(cluster)) == 2, 15, "both nodes registered again")
    client = redis.Redis.from_url(cluster.redis_url)
    wait_for(
        lambda: client.scard(f"{DEFAULT_PREFIX}:blocks:prefill-0") > 0,
        10,
        "prefill-0's cached blocks republished",
    )
    client.close()
    o = run(cluster.router_address, request(PROMPT))
    assert o.code is grpc.StatusCode.OK and o.token_ids == expected
    assert o.final.usage.cached_tokens > 0  # routed on live state: the prefix hit is back
    assert_idle(cluster, expect_nodes=2)
    print(
        f"Redis down {OUTAGE_S:.0f} s: {served} requests served, worst latency "
        f"{max(latencies) * 1e3:.0f} ms; recovered by itself"
    )


def test_false_entries_break_neither_serving_nor_correctness(cluster, demo_model_dir):
    prompts = [f"{PROMPT} Answer {i}." for i in range(6)]
    expected = [run(cluster.router_address, request(p)).token_ids for p in prompts]
    id_prompts = [list(range(1000 + 40 * i, 1040 + 40 * i)) for i in range(6)]
    id_expected = [
        run(cluster.router_address, request(token_ids=ids, max_tokens=4)).token_ids
        for ids in id_prompts
    ]
    # decode-0 forgets them (it cached them while decoding): its claims below are false.
    with grpc.insecure_channel(cluster.admin_address) as ch:
        admin_pb2_grpc.AdminStub(ch).FlushCache(
            admin_pb2.FlushCacheRequest(node_id="decode-0"), timeout=30
        )
    client = redis.Redis.from_url(cluster.redis_url)
    real = {
        k.decode(): v.decode() for k, v in client.hgetall(f"{DEFAULT_PREFIX}:node:decode-0").items()
    }
    # Lies as a node tells them: every field, the packed route field too.
    liar_info = NodeInfo.from_fields(real)
    liar_info.running = liar_info.waiting = 0
    liar_info.kv_blocks_free = liar_info.kv_blocks_total
    zero_load = liar_info.to_fields()
    liar_info.node_id = "phantom"
    liar_info.address = f"127.0.0.1:{free_port()}"  # nobody listens there
    phantom = liar_info.to_fields()
    # decode-0 claims every block of the token-id prompts (it holds none of them).
    hasher = BlockHasher(real["model_id"], int(real["block_size"]))
    lies = [h for ids in id_prompts for h in hasher.hash_blocks(ids)]
    # The phantom claims the text prompts' blocks (hashed as the router does),
    # so the router prefers it for them and must fail over, not merely might.
    frontend = Frontend(EngineConfig.from_kwargs(str(demo_model_dir), max_model_len=1024))
    bait = [h for p in prompts for h in frontend.parse(request(p)).block_hashes.primary]
    assert bait, "the text prompts must fill at least one block"
    stop = threading.Event()

    def keep_lying():
        stamp = client.register_script(
            "local t = redis.call('TIME') "
            "redis.call('HSET', KEYS[1], 'seen_ms', t[1] * 1000 + math.floor(t[2] / 1000))"
        )
        while not stop.is_set():
            pipe = client.pipeline()
            pipe.hset(f"{DEFAULT_PREFIX}:node:phantom", mapping=phantom)
            pipe.sadd(f"{DEFAULT_PREFIX}:nodes", "phantom")
            # A zero-load report from a busy node, every 50 ms.
            pipe.hset(f"{DEFAULT_PREFIX}:node:decode-0", mapping=zero_load)
            pipe.sadd(f"{DEFAULT_PREFIX}:blocks:decode-0", *lies)
            pipe.sadd(f"{DEFAULT_PREFIX}:blocks:phantom", *bait)
            pipe.execute()
            stamp(keys=[f"{DEFAULT_PREFIX}:node:phantom"])
            time.sleep(0.05)

    liar = threading.Thread(target=keep_lying, daemon=True)
    liar.start()
    try:
        time.sleep(0.3)
        for prompt, want in zip(prompts, expected, strict=True):
            o = run(cluster.router_address, request(prompt), timeout=60)
            assert o.code is grpc.StatusCode.OK, o.details
            assert o.token_ids == want
            assert o.final.usage.decode_node == "decode-0"
        # Prompts whose hashes decode-0 falsely claims: it is chosen for its
        # "cache", finds nothing when it verifies, and computes them itself.
        for ids, want in zip(id_prompts, id_expected, strict=True):
            o = run(cluster.router_address, request(token_ids=ids, max_tokens=4), timeout=60)
            assert o.code is grpc.StatusCode.OK, o.details
            assert o.token_ids == want
    finally:
        stop.set()
        liar.join(5)
        client.delete(f"{DEFAULT_PREFIX}:node:phantom", f"{DEFAULT_PREFIX}:blocks:phantom")
        client.srem(f"{DEFAULT_PREFIX}:nodes", "phantom")
        client.close()
    assert metric(cluster, "router", "pdserve_router_retries_total") >= 1  # the phantom failed over
    assert_idle(cluster, expect_nodes=2)


def test_a_stalled_decode_node_is_found_while_redis_is_down(cluster):
    # The router probes a silent stream's decode node itself, not through Redis.
    stream = Stream(
        cluster.router_address, request(PROMPT, max_tokens=300, ignore_eos=True), timeout=120
    )
    assert stream.first.wait(60)
    port = cluster.redis.port
    cluster.redis.stop()
    stalled = component(cluster, "decode-0")
    stalled.process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        outcome = stream.result(60)
    finally:
        stalled.process.send_signal(signal.SIGCONT)
        cluster.redis = RedisServer(port=port).start()
    assert outcome.code is grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
    assert outcome.ended_at - stopped < 10
    print(
        f"Redis down, decode node stopped: stream failed {outcome.ended_at - stopped:.2f} s later"
    )
    wait_for(lambda: len(nodes(cluster)) == 2, 15, "both nodes registered again")
    assert_idle(cluster, expect_nodes=2)
