"""What both node kinds share: flags, heartbeats to Redis, the serve/stop sequence.

A heartbeat publishes the node's load and the block hashes its prefix cache
stored and evicted since the last one, in one Redis round trip. When Redis is
unreachable the node keeps serving and retries with backoff; the events it
could not publish are kept and sent with the next successful heartbeat.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.cluster import Cluster, NodeInfo
from common.engine.engine_thread import EngineThread
from common.grpc_server import SERVER_OPTIONS, add_health, add_reflection, set_serving
from common.metrics.histogram import Histogram
from common.metrics.node import NodeCollector
from common.metrics.server import add_metrics_arguments, serve_metrics
from common.ports import listen
from common.progress_log import DEFAULT_INTERVAL_S as DEFAULT_STATS_INTERVAL_S
from common.progress_log import log_progress
from common.redis_auth import add_redis_auth_arguments, check_redis, redis_options_from_args
from common.reliability import FAULT_DELAYS_ENV, FaultDelays
from common.tls import TLSConfig, add_tls_arguments
from proto import internal_pb2, internal_pb2_grpc

CONTROL_SERVICE = internal_pb2.DESCRIPTOR.services_by_name["NodeControl"].full_name

logger = logging.getLogger(__name__)

# Engine options a node takes from its command line (EngineConfig names).
ENGINE_FLAGS: dict[str, type] = {
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "kvcache_block_size": int,
    "num_kvcache_blocks": int,
    "gpu_memory_utilization": float,
    "dtype": str,
    "device": str,
    "attention_backend": str,
    "served_model_name": str,
    "seed": int,
    "load_format": str,
}


# Engine options read PDSERVE_<OPTION>, except the block size: the router has
# always read PDSERVE_BLOCK_SIZE, and sharing its names (that one,
# PDSERVE_SERVED_MODEL_NAME, PDSERVE_MAX_MODEL_LEN) lets one setting (a
# Kubernetes ConfigMap, say) give the router and the nodes the same value.
_ENGINE_ENV = {"kvcache_block_size": "PDSERVE_BLOCK_SIZE"}


def engine_env_name(name: str) -> str:
    """The environment variable that sets engine option ``name`` (ENGINE_FLAGS or a switch)."""
    return _ENGINE_ENV.get(name, f"PDSERVE_{name.upper()}")


def add_engine_flags(parser: Any) -> None:
    env = os.environ.get
    for name, kind in ENGINE_FLAGS.items():
        var = engine_env_name(name)
        # An empty value counts as unset. A string default goes through `type`,
        # so a bad value is reported like a bad flag.
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=env(var) or None, help=f"[{var}]"
        )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        default=env(engine_env_name("enforce_eager")) == "1" or None,
        help="[PDSERVE_ENFORCE_EAGER=1]",
    )
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=env(engine_env_name("skip_tokenizer_init")) == "1" or None,
        help="no tokenizer: token ids in, token ids out (dummy-weight models) "
        "[PDSERVE_SKIP_TOKENIZER_INIT=1]",
    )


def engine_kwargs(args: Any) -> dict[str, Any]:
    out = {n: getattr(args, n) for n in ENGINE_FLAGS if getattr(args, n, None) is not None}
    for flag in ("enforce_eager", "skip_tokenizer_init"):
        if getattr(args, flag, None):
            out[flag] = True
    return out


def fault_delays(node_id: str) -> FaultDelays:
    """The fault-injection delays (tests/faults only), loudly."""
    faults = FaultDelays.from_env()
    if faults:
        logger.warning("%s: fault injection on (%s)", node_id, os.environ[FAULT_DELAYS_ENV])
    return faults


def default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass
class Heartbeat:
    """Publishes a node's state to Redis every ``interval_s`` seconds."""

    cluster: Cluster
    engine: EngineThread
    info: NodeInfo
    interval_s: float = 0.5
    max_backoff_s: float = 5.0
    # Returns the node's counters (NodeInfo field names) for each heartbeat.
    counters: Callable[[], dict[str, int]] | None = None
    consecutive_failures: int = 0
    failures: int = 0  # since start (pdserve_redis_errors_total)
    published: int = 0
    # Cache changes not yet published (kept across failed heartbeats); last wins.
    _pending: dict[bytes, bool] = field(default_factory=dict)
    _reset: bool = True
    # After failed heartbeats Redis may have restarted empty: republish every
    # cached block hash (not only the changes) with the next beat that succeeds.
    _resync: bool = False
    # One beat at a time: shutdown beats at once (to publish `draining`) while
    # the periodic task may be mid-beat, and both edit `_pending`.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # A take of cache events queued on the engine thread and not yet answered.
    _events_future: Future | None = None

    def refresh_info(self) -> NodeInfo:
        s = self.engine.stats
        info = self.info
        info.kv_blocks_total = s.num_kv_blocks
        info.kv_blocks_free = s.num_free_kv_blocks
        info.running = s.num_running + s.num_reserved
        info.waiting = s.num_waiting
        info.queued_prefill_tokens = s.num_queued_prefill_tokens
        info.preemptions = s.num_preemptions
        for name, value in (self.counters() if self.counters else {}).items():
            setattr(info, name, value)
        return info

    async def beat(self) -> None:
        async with self._lock:
            await self._beat()

    async def _beat(self) -> None:
        if self._resync:
            # Queued after any take still outstanding, so this snapshot supersedes it.
            self._events_future = None
            cached = await asyncio.wrap_future(self.engine.call(_take_all_cached))
            self._pending = dict.fromkeys(cached, True)
            self._reset = True
            self._resync = False
            events = None
        else:
            events = await self._cache_events()
        for h in events.removed if events else ():  # the two lists are disjoint
            self._pending.pop(h, None)
            self._pending[h] = False
        for h in events.stored if events else ():
            self._pending.pop(h, None)
            self._pending[h] = True
        stored = [h for h, v in self._pending.items() if v]
        removed = [h for h, v in self._pending.items() if not v]
        await self.cluster.heartbeat(
            self.refresh_info(), stored=stored, removed=removed, reset_blocks=self._reset
        )
        self._pending.clear()
        self._reset = False
        self.published += 1

    async def _cache_events(self):
        """The block manager's changes since the last take, or None when the
        engine is in the middle of a long step: the beat goes out with the load
        anyway and the changes follow with a later one. A heartbeat must not
        wait for a step -- routers take a node silent for a few seconds for a
        dead one, and a step over hundreds of sequences on a CPU can take that
        long."""
        if self._events_future is None:
            self._events_future = self.engine.call(lambda e: e.block_manager.take_events())
        waiting = asyncio.shield(asyncio.wrap_future(self._events_future))
        try:
            events = await asyncio.wait_for(waiting, timeout=max(0.05, self.interval_s))
        except TimeoutError:
            return None
        self._events_future = None
        return events

    async def run_forever(self) -> None:
        task = asyncio.current_task()
        # Checked on every turn, not only through CancelledError: the Redis
        # client can swallow a cancellation that lands mid-read (or turn it
        # into another error), and a heartbeat loop that outlives its
        # cancellation would hang the node's shutdown.
        while not task.cancelling():
            try:
                await self.beat()
                if self.consecutive_failures:
                    logger.info("Redis reachable again; heartbeats resumed")
                self.consecutive_failures = 0
                await asyncio.sleep(self.interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if task.cancelling():
                    break
                self.consecutive_failures += 1
                self._resync = True
                self.failures += 1
                delay = min(self.max_backoff_s, self.interval_s * 2**self.consecutive_failures)
                logger.warning("heartbeat to Redis failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
        raise asyncio.CancelledError

    async def deregister(self) -> None:
        for attempt in range(2):  # a pooled connection may have died with the heartbeat task
            try:
                await self.cluster.deregister(self.info.node_id)
                return
            except Exception as e:
                if attempt:  # leaving anyway; the TTL removes us
                    logger.warning("could not deregister from Redis: %s", e)


def _take_all_cached(engine) -> list[bytes]:
    """Every block hash the node's prefix cache holds now (the events so far are
    superseded by this snapshot)."""
    engine.block_manager.take_events()
    return engine.block_manager.cached_hashes()


def add_node_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    """Flags (and their PDSERVE_* variables) that prefill and decode nodes share."""
    env = os.environ.get
    p.add_argument(
        "--model", default=env("PDSERVE_MODEL"), help="HF model directory [PDSERVE_MODEL]"
    )
    p.add_argument(
        "--host", default=env("PDSERVE_HOST", "0.0.0.0"), help="listen address [PDSERVE_HOST]"
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env("PDSERVE_PORT", str(default_port))),
        help="gRPC port [PDSERVE_PORT]",
    )
    p.add_argument(
        "--advertise-host",
        default=env("PDSERVE_ADVERTISE_HOST"),
        help="host other nodes reach this one at [PDSERVE_ADVERTISE_HOST; default: this host's address]",
    )
    p.add_argument(
        "--node-id", default=env("PDSERVE_NODE_ID"), help="id in the registry [PDSERVE_NODE_ID]"
    )
    p.add_argument(
        "--redis-url",
        default=env("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="cluster state [PDSERVE_REDIS_URL]",
    )
    p.add_argument(
        "--heartbeat-interval", type=float, default=float(env("PDSERVE_HEARTBEAT_S", "0.5"))
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=float(env("PDSERVE_LOG_STATS_INTERVAL_S", str(DEFAULT_STATS_INTERVAL_S))),
        help="seconds between progress lines while busy (tok/s, queue, KV); 0: none "
        "[PDSERVE_LOG_STATS_INTERVAL_S]",
    )
    p.add_argument("--node-ttl", type=float, default=float(env("PDSERVE_NODE_TTL_S", "5")))
    p.add_argument(
        "--transfer-timeout", type=float, default=float(env("PDSERVE_TRANSFER_TIMEOUT_S", "30"))
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env("PDSERVE_DRAIN_TIMEOUT_S", "30")),
        help="on SIGTERM, seconds to let in-flight requests finish (a second signal: "
        "stop now) [PDSERVE_DRAIN_TIMEOUT_S]",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=int(env("PDSERVE_MAX_QUEUED_REQUESTS", "256")),
        help="requests waiting for the engine beyond which new ones get RESOURCE_EXHAUSTED "
        "(0: no bound) [PDSERVE_MAX_QUEUED_REQUESTS]",
    )
    p.add_argument(
        "--verify-kv",
        action="store_true",
        default=env("PDSERVE_VERIFY_KV") == "1",
        help="checksum every KV transfer on both sides (slow; for tests) [PDSERVE_VERIFY_KV=1]",
    )
    p.add_argument(
        "--enable-reflection", action="store_true", default=env("PDSERVE_REFLECTION") == "1"
    )
    add_metrics_arguments(p)
    add_tls_arguments(p)
    add_redis_auth_arguments(p)
    add_engine_flags(p)


class NodeControlServicer(internal_pb2_grpc.NodeControlServicer):
    """Operations on the node itself (thin: the work happens on the engine thread)."""

    def __init__(self, engine: EngineThread) -> None:
        self.engine = engine

    async def FlushCache(self, request, context: grpc.aio.ServicerContext):
        flushed = await asyncio.wrap_future(self.engine.call(lambda e: e.reset_prefix_cache()))
        logger.info("prefix cache flushed: %d blocks evicted", flushed)
        return internal_pb2.NodeFlushResponse(blocks_flushed=flushed)


async def run_node(
    args: argparse.Namespace,
    *,
    service: str,
    add_servicer: Callable[[grpc.aio.Server], None],
    thread: EngineThread,
    info: NodeInfo,
    counters: Callable[[], dict[str, int]],
    close: Callable[[], Awaitable[None]],
    histograms: Callable[[], dict[str, Histogram]] | None = None,
) -> int:
    """Serve one node until SIGINT/SIGTERM, then drain and leave the cluster cleanly.

    Order matters: the node is in Redis before health says SERVING (so the
    router can route to whatever answers). On a signal it says NOT_SERVING and
    publishes ``draining`` at once (routers stop choosing it), lets the
    requests it has finish for up to ``--drain-timeout`` seconds (a second
    signal cuts this short), then leaves Redis and stops its gRPC server.
    """
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    cluster = Cluster.from_url(args.redis_url, redis_options_from_args(args), ttl_s=args.node_ttl)
    await check_redis(cluster.redis, args.redis_url)  # refused credentials: stop here
    metrics = NodeCollector(info, thread, counters=counters, histograms=histograms)
    serve_metrics(args.metrics_port, args.host, [metrics])
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(server)
    internal_pb2_grpc.add_NodeControlServicer_to_server(NodeControlServicer(thread), server)
    health = await add_health(server, [service, CONTROL_SERVICE])
    if args.enable_reflection:
        add_reflection(server, [service, CONTROL_SERVICE])
    listen(server, args.host, args.port, "--port", "node gRPC API", TLSConfig.from_args(args))
    await server.start()

    heartbeat = Heartbeat(
        cluster, thread, info, interval_s=args.heartbeat_interval, counters=counters
    )
    metrics.heartbeat = heartbeat
    await heartbeat.beat()
    beating = asyncio.create_task(heartbeat.run_forever())
    progress = asyncio.create_task(log_progress(thread, info.node_id, args.log_stats_interval))
    await set_serving(health, [service, CONTROL_SERVICE], True)
    logger.info("%s node %s serving on %s:%d", info.role.value, info.node_id, args.host, args.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await set_serving(health, [service, CONTROL_SERVICE], False)
    info.draining = True  # kept by every later heartbeat
    with contextlib.suppress(Exception):  # Redis down: routers drop us at the TTL
        await heartbeat.beat()
    hurry = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, hurry.set)
    left = await drain(thread, args.drain_timeout, hurry, info.node_id)
    logger.info(
        "%s node %s stopping%s",
        info.role.value,
        info.node_id,
        f" with {left} requests unfinished" if left else "",
    )
    # From here on, stopping must not hang whatever a peer or a stream does.
    watchdog = threading.Timer(SHUTDOWN_LIMIT_S, _give_up, args=(info.node_id,))
    watchdog.daemon = True
    watchdog.start()
    beating.cancel()
    progress.cancel()
    await asyncio.wait({beating}, timeout=5)
    await heartbeat.deregister()
    # Grace for the last messages of finished streams; then cancel the rest.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.stop(grace=2), timeout=10)
    await close()
    thread.stop()
    await cluster.close()
    watchdog.cancel()
    return 0


# After the drain, the rest of a shutdown gets this long before the process exits anyway.
SHUTDOWN_LIMIT_S = 30.0


def _give_up(node_id: str) -> None:
    logger.error("%s: shutdown did not finish in %.0f s; exiting now", node_id, SHUTDOWN_LIMIT_S)
    logging.shutdown()
    os._exit(1)


def in_flight(engine) -> int:
    """Requests a node still owes someone: queued, running, reserved, or held for a transfer."""
    return engine.get_num_unfinished_requests() + len(engine.scheduler.held)


async def drain(thread: EngineThread, timeout_s: float, hurry: asyncio.Event, name: str) -> int:
    """Wait until the engine owes nothing, ``timeout_s`` passes or ``hurry`` is set;
    returns the requests left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last_report = 0.0
    while True:
        if not thread.alive:
            return 0
        left = await asyncio.wrap_future(thread.call(in_flight))
        now = loop.time()
        if left == 0 or now >= deadline or hurry.is_set():
            return left
        if now - last_report >= 5:
            logger.info(
                "%s draining: %d requests in flight (%.0f s left)", name, left, deadline - now
            )
            last_report = now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hurry.wait(), timeout=min(0.1, deadline - now))
