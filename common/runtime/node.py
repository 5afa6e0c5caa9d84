"""What both node kinds share at run time: the start-up sequence, the
NodeControl service, and serving until a signal, then draining and leaving the
cluster (docs/architecture.md, "Shutdown")."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from common.cluster.redis_auth import check_redis, redis_options_from_args
from common.cluster.state import Cluster, NodeInfo, NodeRole, now_ms
from common.grpc_server import SERVER_OPTIONS, add_health, add_reflection, set_serving
from common.metrics.gc import GcCollector
from common.metrics.histogram import Histogram
from common.metrics.node import NodeCollector
from common.metrics.server import serve_metrics
from common.metrics.steps import StepHistograms
from common.runtime.config import default_host, engine_kwargs
from common.runtime.gc_heap import GcPauses, freeze_heap
from common.runtime.heartbeat import Heartbeat
from common.runtime.ports import PlannedPort, check_free, listen
from common.runtime.progress_log import log_progress
from common.runtime.reliability import crash_at_start
from common.tls import TLSConfig
from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from proto import internal_pb2, internal_pb2_grpc

CONTROL_SERVICE = internal_pb2.DESCRIPTOR.services_by_name["NodeControl"].full_name

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeEngine:
    """A node's engine, started, and the names it goes by."""

    config: EngineConfig
    engine: LLMEngine
    thread: EngineThread
    node_id: str
    advertise_host: str

    def info(self, role: NodeRole, port: int, **extra) -> NodeInfo:
        """The node's registration (the heartbeat keeps its load fields current)."""
        tp = self.config.tensor_parallel_size
        return NodeInfo(
            node_id=self.node_id,
            role=role,
            address=f"{self.advertise_host}:{port}",
            model_id=self.config.served_model_name,
            block_size=self.config.kvcache_block_size,
            max_num_seqs=self.config.max_num_seqs,
            tensor_parallel_size=tp,
            num_gpus=tp if self.engine.model_runner.device.type == "cuda" else 0,
            started_ms=now_ms(),
            **extra,
        )


def start_node_engine(
    args: argparse.Namespace, role: NodeRole, ports: list[PlannedPort], **overrides
) -> NodeEngine:
    """The start-up sequence both node kinds share: flags that can fail, and
    ``ports`` already taken, fail before the model loads; then the engine
    (publishing its cache events for the heartbeat) starts on its own thread."""
    if not args.model:
        raise ValueError("--model (or PDSERVE_MODEL) is required")
    TLSConfig.from_args(args)
    redis_options_from_args(args)
    check_free(args.host, ports)
    crash_at_start(args.node_id or "")
    config = EngineConfig.from_kwargs(args.model, **(engine_kwargs(args) | overrides))
    if args.verify_kv and config.tensor_parallel_size > 1:
        raise ValueError(
            "--verify-kv checks transfers between nodes of tensor-parallel size 1 only; "
            f"this node has --tensor-parallel-size {config.tensor_parallel_size}"
        )
    engine = LLMEngine(config)
    engine.enable_cache_events()
    advertise = args.advertise_host or default_host()
    node_id = args.node_id or f"{role.value}-{advertise}-{args.port}"
    thread = EngineThread(engine, name=f"engine-{node_id}").start()
    return NodeEngine(config, engine, thread, node_id, advertise)


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
    steps = StepHistograms()
    # On the engine thread, which owns the engine's step log.
    thread.after_step.append(lambda _outputs: steps.drain(thread.engine.step_log))
    metrics = NodeCollector(info, thread, counters=counters, histograms=histograms, steps=steps)
    gc_pauses = GcPauses()  # installed once serving (below)
    serve_metrics(args.metrics_port, args.host, [metrics, GcCollector(gc_pauses, metrics.labels)])
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(server)
    internal_pb2_grpc.add_NodeControlServicer_to_server(NodeControlServicer(thread), server)
    health = await add_health(server, [service, CONTROL_SERVICE])
    if args.enable_reflection:
        add_reflection(server, [service, CONTROL_SERVICE])
    listen(server, args.host, args.port, "--port", "node gRPC API", TLSConfig.from_args(args))
    # Before the port opens: a SIGTERM once a router can reach us (the first
    # heartbeat registers us) drains and exits 0, never the default's kill.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()

    heartbeat = Heartbeat(
        cluster, thread, info, interval_s=args.heartbeat_interval, counters=counters
    )
    metrics.heartbeat = heartbeat
    await heartbeat.beat()
    beating = asyncio.create_task(heartbeat.run_forever())
    progress = asyncio.create_task(log_progress(thread, info.node_id, args.log_stats_interval))
    # Start-up is over (model, graphs, servers): what is alive now lives as long
    # as the process, and full collections should stop walking it.
    if args.gc_freeze:
        freeze_heap(f"{info.role.value} node {info.node_id}")
    # Timed from here on: start-up's collections (the freeze's own among them)
    # delay no stream, and warning of them would say they did.
    gc_pauses.install()
    await set_serving(health, [service, CONTROL_SERVICE], True)
    logger.info("%s node %s serving on %s:%d", info.role.value, info.node_id, args.host, args.port)

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
    return engine.get_num_unfinished_requests() + engine.num_held()


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
