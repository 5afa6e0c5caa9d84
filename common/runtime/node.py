"""What both node kinds share at run time: the start-up sequence, the
NodeControl service, and serving until a signal, then draining and leaving the
cluster (docs/architecture.md, "Shutdown")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from common.cluster.numerics import registered_weight_dtype
from common.cluster.redis_auth import check_redis
from common.cluster.state import Cluster, NodeInfo, NodeRole, lora_adapters_json, now_ms
from common.grpc_server import SERVER_OPTIONS, add_health, add_reflection, set_serving
from common.metrics.gc import GcCollector
from common.metrics.histogram import Histogram
from common.metrics.node import NodeCollector
from common.metrics.server import serve_metrics
from common.metrics.steps import StepHistograms
from common.runtime.config import NodeConfig
from common.runtime.gc_heap import GcPauses, freeze_heap
from common.runtime.heartbeat import Heartbeat
from common.runtime.node_lora import AdapterRefused, NodeAdapters
from common.runtime.node_lora_control import NodeLoRAControl
from common.runtime.ports import PlannedPort, check_free, listen
from common.runtime.progress_log import log_progress
from common.runtime.reliability import crash_at_start
from common.tracing import Tracing
from engine.config import EngineConfig
from engine.engine_thread import EngineThread
from engine.kv_cache_dtype import storage_name
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
    tracing: Tracing  # the node's spans (common/tracing.py)
    adapters: NodeAdapters  # its LoRA adapters (--lora-modules)

    def info(self, role: NodeRole, port: int, **extra) -> NodeInfo:
        """The node's registration (the heartbeat keeps its load fields current)."""
        tp = self.config.tensor_parallel_size
        weights = self.engine.model_dtype_name
        return NodeInfo(
            node_id=self.node_id,
            role=role,
            address=f"{self.advertise_host}:{port}",
            model_id=self.config.served_model_name,
            block_size=self.config.kvcache_block_size,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.config.max_model_len,
            model_family=self.config.model_config.family,
            tensor_parallel_size=tp,
            num_gpus=tp if self.engine.model_runner.device.type == "cuda" else 0,
            started_ms=now_ms(),
            lora_adapters=lora_adapters_json(self.adapters.digests()),
            weight_dtype=registered_weight_dtype(self.config.quantization, weights),
            kv_cache_dtype=storage_name(self.config.kv_cache_dtype, weights),
            **extra,
        )


def start_node_engine(
    node: NodeConfig, role: NodeRole, ports: list[PlannedPort], **overrides
) -> NodeEngine:
    """The start-up sequence both node kinds share: ``ports`` already taken fail
    before the model loads; then the engine (publishing its cache events for
    the heartbeat) starts on its own thread."""
    check_free(node.host, ports)
    crash_at_start(node.node_id or "")
    config = EngineConfig.from_kwargs(node.model, **(node.engine | overrides))
    if node.verify_kv and config.tensor_parallel_size > 1:
        raise ValueError(
            "--verify-kv checks transfers between nodes of tensor-parallel size 1 only; "
            f"this node has --tensor-parallel-size {config.tensor_parallel_size}"
        )
    node_id = node.node_id or f"{role.value}-{node.advertise_host}-{node.port}"
    tracing = Tracing(f"pdserve-{role.value}", node.otlp_endpoint, node_id)
    engine = LLMEngine(config)
    adapters = NodeAdapters()
    for lora in node.lora_modules:  # read and checked now: a bad adapter fails the start
        engine.add_lora(lora)
        adapters.add(lora, engine.model_runner.lora.known[lora.lora_int_id][1])
        logger.info("LoRA adapter %r loaded from %s", lora.lora_name, lora.lora_path)
    engine.enable_cache_events()
    thread = EngineThread(engine, name=f"engine-{node_id}").start()
    return NodeEngine(config, engine, thread, node_id, node.advertise_host, tracing, adapters)


class NodeControlServicer(internal_pb2_grpc.NodeControlServicer):
    """Operations on the node itself (thin: the work happens on the engine thread)."""

    def __init__(self, engine: EngineThread, lora: NodeLoRAControl) -> None:
        self.engine = engine
        self.lora = lora

    async def LoadLoRA(self, request, context: grpc.aio.ServicerContext):
        try:
            return await self.lora.load(request.name, request.path)
        except AdapterRefused as e:
            await context.abort(e.code, str(e))

    async def UnloadLoRA(self, request, context: grpc.aio.ServicerContext):
        try:
            return await self.lora.unload(request.name)
        except AdapterRefused as e:
            await context.abort(e.code, str(e))

    async def FlushCache(self, request, context: grpc.aio.ServicerContext):
        flushed = await asyncio.wrap_future(self.engine.call(lambda e: e.reset_prefix_cache()))
        logger.info("prefix cache flushed: %d blocks evicted", flushed)
        return internal_pb2.NodeFlushResponse(blocks_flushed=flushed)


async def run_node(
    node: NodeConfig,
    *,
    service: str,
    add_servicer: Callable[[grpc.aio.Server], None],
    thread: EngineThread,
    info: NodeInfo,
    counters: Callable[[], dict[str, int]],
    close: Callable[[], Awaitable[None]],
    histograms: Callable[[], dict[str, Histogram]] | None = None,
    adapters: NodeAdapters | None = None,
) -> int:
    """Serve one node until SIGINT/SIGTERM, then drain and leave the cluster cleanly.

    Order matters: the node is in Redis before health says SERVING (so the
    router can route to whatever answers). On a signal it says NOT_SERVING and
    publishes ``draining`` at once (routers stop choosing it), lets the
    requests it has finish for up to ``--drain-timeout`` seconds (a second
    signal cuts this short), then leaves Redis and stops its gRPC server.
    """
    cluster = Cluster.from_url(node.redis_url, node.redis_options, ttl_s=node.node_ttl_s)
    await check_redis(cluster.redis, node.redis_url)  # refused credentials: stop here
    metrics, gc_pauses = _serve_metrics(node, info, thread, counters, histograms)
    services = [service, CONTROL_SERVICE]
    lora = NodeLoRAControl(thread, adapters or NodeAdapters(), info)
    server, health = await _grpc_server(node, thread, add_servicer, services, lora)
    # Before the port opens: a SIGTERM once a router can reach us (the first
    # heartbeat registers us) drains and exits 0, never the default's kill.
    stop = _on_signals()
    await server.start()
    heartbeat = await _first_heartbeat(node, cluster, thread, info, lora.counters(counters))
    lora.publish = heartbeat.beat  # a load or an unload is published before its answer
    metrics.heartbeat = heartbeat
    beating = asyncio.create_task(heartbeat.run_forever())
    progress = asyncio.create_task(log_progress(thread, info.node_id, node.log_stats_interval_s))
    # Start-up is over (model, graphs, servers): what is alive now lives as long
    # as the process, and full collections should stop walking it.
    if node.gc_freeze:
        freeze_heap(f"{info.role.value} node {info.node_id}")
    # Timed from here on: start-up's collections (the freeze's own among them)
    # delay no stream, and warning of them would say they did.
    gc_pauses.install()
    await set_serving(health, services, True)
    logger.info("%s node %s serving on %s:%d", info.role.value, info.node_id, node.host, node.port)
    await stop.wait()
    await set_serving(health, services, False)
    await _drain(node, info, thread, heartbeat)
    # From here on, stopping must not hang whatever a peer or a stream does.
    watchdog = threading.Timer(SHUTDOWN_LIMIT_S, _give_up, args=(info.node_id,))
    watchdog.daemon = True
    watchdog.start()
    progress.cancel()
    await _leave(beating, heartbeat, server)
    await close()
    thread.stop()
    await cluster.close()
    watchdog.cancel()
    return 0


async def _first_heartbeat(node: NodeConfig, cluster, thread, info, counters) -> Heartbeat:
    """The node's heartbeat, registered by its first beat."""
    heartbeat = Heartbeat(
        cluster, thread, info, interval_s=node.heartbeat_interval_s, counters=counters
    )
    heartbeat.watch_idle(asyncio.get_running_loop())
    await heartbeat.beat()
    return heartbeat


async def _leave(beating: asyncio.Task, heartbeat: Heartbeat, server: grpc.aio.Server) -> None:
    """Out of Redis, then the gRPC server stopped."""
    beating.cancel()
    await asyncio.wait({beating}, timeout=5)
    await heartbeat.deregister()
    # Grace for the last messages of finished streams; then cancel the rest.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(server.stop(grace=2), timeout=10)


def _serve_metrics(node: NodeConfig, info: NodeInfo, thread: EngineThread, counters, histograms):
    """/metrics on ``--metrics-port``: the node's collector (its heartbeat set
    later) and the GC pauses' (installed once serving)."""
    steps = StepHistograms()
    # On the engine thread, which owns the engine's step log.
    thread.after_step.append(lambda _outputs: steps.drain(thread.engine.step_log))
    metrics = NodeCollector(info, thread, counters=counters, histograms=histograms, steps=steps)
    gc_pauses = GcPauses()
    serve_metrics(node.metrics_port, node.host, [metrics, GcCollector(gc_pauses, metrics.labels)])
    return metrics, gc_pauses


async def _grpc_server(node: NodeConfig, thread: EngineThread, add_servicer, services, lora):
    """The node's gRPC server (not started), with health NOT_SERVING until told."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_servicer(server)
    internal_pb2_grpc.add_NodeControlServicer_to_server(NodeControlServicer(thread, lora), server)
    health = await add_health(server, services)
    if node.enable_reflection:
        add_reflection(server, services)
    listen(server, node.host, node.port, "--port", "node gRPC API", node.tls)
    return server, health


def _on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set (instead of killing the process)."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    return event


async def _drain(node: NodeConfig, info: NodeInfo, thread: EngineThread, heartbeat) -> None:
    """Publish ``draining`` and let the requests the node owes finish, for up to
    ``--drain-timeout`` (a second signal cuts it short)."""
    info.draining = True  # kept by every later heartbeat
    with contextlib.suppress(Exception):  # Redis down: routers drop us at the TTL
        await heartbeat.beat()
    hurry = _on_signals()
    left = await drain(thread, node.drain_timeout_s, hurry, info.node_id)
    unfinished = f" with {left} requests unfinished" if left else ""
    logger.info("%s node %s stopping%s", info.role.value, info.node_id, unfinished)


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
