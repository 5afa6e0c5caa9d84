"""What the fault-injection suite shares: clusters of real processes on a real
Redis, node state read straight from Redis, and the idle invariant.

Every test ends with ``assert_idle``: once nothing is in flight, every node's
free blocks (never-cached plus evictable cached ones) equal its total, and
nothing is running, waiting or reserved. A leaked reservation, a held prefill
block or a sequence stuck in a queue breaks it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import redis

from common.cluster.state import DEFAULT_PREFIX, NodeInfo
from pdserve.launcher import ClusterSpec, Component, LocalCluster
from pdserve.redis_server import free_port
from proto import pdserve_pb2, pdserve_pb2_grpc
from proto.client import build_request

# Heartbeats this often in the suite, so that "freed within 1 s" is measurable
# through Redis with little lag.
HEARTBEAT_S = "0.1"


def spec(model_dir, log_dir, *, node_args=(), router_args=(), **kwargs) -> ClusterSpec:
    return ClusterSpec(
        model=str(model_dir),
        port=free_port(),
        admin_port=free_port(),
        engine_args=["--max-model-len", "1024", *kwargs.pop("engine_args", [])],
        node_args=["--heartbeat-interval", HEARTBEAT_S, "--drain-timeout", "5", *node_args],
        router_args=list(router_args),
        log_dir=str(log_dir),
        start_timeout_s=300,
        stop_grace_s=10,
        **kwargs,
    )


def component(cluster: LocalCluster, name: str) -> Component:
    return next(c for c in cluster.components if c.name == name)


def nodes(cluster: LocalCluster) -> dict[str, NodeInfo]:
    """Every registered node, as its last heartbeat published it."""
    client = redis.Redis.from_url(cluster.redis_url, socket_timeout=5)
    try:
        ids = sorted(i.decode() for i in client.smembers(f"{DEFAULT_PREFIX}:nodes"))
        out = {}
        for node_id in ids:
            raw = client.hgetall(f"{DEFAULT_PREFIX}:node:{node_id}")
            if raw:
                out[node_id] = NodeInfo.from_fields(raw)
        return out
    finally:
        client.close()


def idle_problems(infos: dict[str, NodeInfo]) -> list[str]:
    problems = []
    for info in infos.values():
        if info.kv_blocks_free != info.kv_blocks_total:
            problems.append(
                f"{info.node_id}: {info.kv_blocks_free} of {info.kv_blocks_total} blocks free"
            )
        if info.running or info.waiting:
            problems.append(f"{info.node_id}: {info.running} running, {info.waiting} waiting")
    return problems


def wait_idle(cluster: LocalCluster, timeout_s: float, expect_nodes: int | None = None) -> float:
    """Seconds until every node reports itself idle with all blocks free (after
    a heartbeat newer than this call); fails with what is left after ``timeout_s``."""
    start = time.monotonic()
    since_ms = int(time.time() * 1000)
    while True:
        infos = nodes(cluster)
        fresh = all(i.updated_ms > since_ms for i in infos.values())
        problems = idle_problems(infos)
        if expect_nodes is not None and len(infos) != expect_nodes:
            problems.append(f"{len(infos)} nodes registered, expected {expect_nodes}")
        if fresh and not problems:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(
                f"not idle {timeout_s:g} s later: {'; '.join(problems) or 'heartbeats stale'}"
            )
        time.sleep(0.02)


def assert_idle(cluster: LocalCluster, expect_nodes: int | None = None) -> None:
    wait_idle(cluster, timeout_s=10, expect_nodes=expect_nodes)


def counters(cluster: LocalCluster, *names: str) -> dict[str, dict[str, int]]:
    return {
        node_id: {n: getattr(info, n) for n in names} for node_id, info in nodes(cluster).items()
    }


def request(prompt: str | None = None, **kwargs) -> pdserve_pb2.GenerateRequest:
    """A greedy GenerateRequest (proto.client.build_request's arguments)."""
    kwargs.setdefault("temperature", 0.0)
    kwargs.setdefault("max_tokens", 8)
    return build_request(prompt, **kwargs)


@dataclass
class Outcome:
    """How one streamed request ended, as its client saw it."""

    code: grpc.StatusCode | None = None
    details: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pdserve_pb2.TokenLogprobs] = field(default_factory=list)
    text: str = ""
    final: pdserve_pb2.Final | None = None
    first_at: float | None = None
    ended_at: float | None = None
    request_ids: set[str] = field(default_factory=set)


class Stream:
    """A Generate call consumed on a thread, cancellable, timed."""

    def __init__(self, address: str, req: pdserve_pb2.GenerateRequest, timeout: float = 300):
        self.channel = grpc.insecure_channel(address)
        self.call = pdserve_pb2_grpc.RouterStub(self.channel).Generate(req, timeout=timeout)
        self.outcome = Outcome()
        self.first = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        out = self.outcome
        try:
            for resp in self.call:
                out.request_ids.add(resp.request_id)
                for delta in resp.deltas:
                    out.token_ids.extend(delta.token_ids)
                    out.logprobs.extend(delta.logprobs)
                    out.text += delta.text
                if resp.deltas and out.first_at is None:
                    out.first_at = time.monotonic()
                    self.first.set()
                if resp.HasField("final"):
                    out.final = resp.final
            out.code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out.code, out.details = e.code(), e.details() or ""
        finally:
            out.ended_at = time.monotonic()
            self.first.set()
            self.done.set()
            self.channel.close()

    def cancel(self) -> None:
        self.call.cancel()

    def result(self, timeout: float = 300) -> Outcome:
        if not self.done.wait(timeout):
            raise AssertionError(f"stream still open after {timeout} s")
        return self.outcome


def run(address: str, req: pdserve_pb2.GenerateRequest, timeout: float = 300) -> Outcome:
    return Stream(address, req, timeout).result(timeout + 10)


def set_drained(cluster: LocalCluster, node_id: str, drained: bool) -> None:
    """What `pdctl drain/undrain` does: every router stops (or resumes) choosing the node."""
    client = redis.Redis.from_url(cluster.redis_url, socket_timeout=5)
    try:
        key = f"{DEFAULT_PREFIX}:draining"
        client.sadd(key, node_id) if drained else client.srem(key, node_id)
    finally:
        client.close()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)
    return value
