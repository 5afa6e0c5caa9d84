"""The router on each event loop (common/runtime/event_loop.py): a real `pdserve router`
process with `--event-loop asyncio` and with `--event-loop uvloop`, a real
redis-server and a fake decode node (a real grpc.aio server registered in Redis,
no model), streaming over gRPC and over the OpenAI HTTP API on both loops.

The rest of the suite runs the default (uvloop where installed, as CI installs
it); this file keeps asyncio's own loop, the fallback, exercised too."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import threading
import time

import grpc
import pytest

from benchmarks.fake_decode_node import FakeWorker, fake_servicer
from common.cluster.state import Cluster, NodeInfo, NodeRole
from common.runtime.event_loop import ASYNCIO, UVLOOP, loop_factory
from engine.models.shapes import write_shape_dir
from pdserve.redis_server import RedisServer, free_port
from proto import internal_pb2_grpc
from proto.client import generate

pytestmark = pytest.mark.timeout(300)

TOKENS = 5


def _serve_fake_node(redis_url: str, port: int, model_id: str, stop: threading.Event) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        # The router benchmarks' fake node: max_tokens one-token messages, no model.
        internal_pb2_grpc.add_DecodeNodeServicer_to_server(fake_servicer(FakeWorker()), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        cluster = Cluster.from_url(redis_url)
        info = NodeInfo(
            "fake-decode-0",
            NodeRole.DECODE,
            f"127.0.0.1:{port}",
            model_id,
            16,
            kv_blocks_total=1 << 16,
            kv_blocks_free=1 << 16,
            max_num_seqs=256,
        )
        try:
            while not stop.is_set():
                await cluster.heartbeat(info)
                await asyncio.sleep(0.2)
        finally:
            await server.stop(0)
            await cluster.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    model_dir = write_shape_dir("smollm2-135m", tmp_path_factory.mktemp("loops") / "model")
    stop = threading.Event()
    with RedisServer() as redis:
        thread = threading.Thread(
            target=_serve_fake_node,
            args=(redis.url, free_port(), model_dir.name, stop),
            daemon=True,
        )
        thread.start()
        yield redis.url, model_dir
        stop.set()
        thread.join(10)


def _start_router(redis_url: str, model_dir, loop: str, log_path):
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--model", str(model_dir)]
    cmd += ["--redis-url", redis_url, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--admin-port", str(free_port()), "--http-port", str(http_port)]
    cmd += ["--skip-tokenizer-init", "--metrics-port", "0", "--event-loop", loop]
    log = open(log_path, "w")  # noqa: SIM115 (closed with the process below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, log, f"127.0.0.1:{port}", http_port


def _generate_until_routed(address: str, timeout_s: float = 60) -> list:
    """The first stream that goes through (the router sees the node after a heartbeat)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(generate(address, token_ids=[1, 2, 3], max_tokens=TOKENS, timeout=10))
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.parametrize("loop", [ASYNCIO, UVLOOP])
def test_router_streams_on_each_loop(fake_cluster, loop, tmp_path):
    if loop == UVLOOP and loop_factory(UVLOOP)[0] is None:
        pytest.skip("uvloop is not installed")
    redis_url, model_dir = fake_cluster
    log_path = tmp_path / "router.log"
    proc, log, address, http_port = _start_router(redis_url, model_dir, loop, log_path)
    try:
        responses = _generate_until_routed(address)
        token_ids = [t for r in responses for d in r.deltas for t in d.token_ids]
        assert token_ids == [100 + i for i in range(TOKENS)]
        assert responses[-1].final.usage.completion_tokens == TOKENS

        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        body = {"prompt": [1, 2, 3], "max_tokens": TOKENS, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body))
        reply = conn.getresponse()
        assert reply.status == 200
        events = [line[6:].strip() for line in reply if line.startswith(b"data: ")]
        conn.close()
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == " tok" * TOKENS
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
        log.close()
    logged = log_path.read_text()
    assert f"event loop: {loop}" in logged, logged
