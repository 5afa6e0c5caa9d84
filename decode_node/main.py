"""`pdserve decode`: run one decode node."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

import grpc

from common.cluster import Cluster, NodeRole
from common.engine.config import EngineConfig
from common.engine.engine_thread import EngineThread
from common.engine.llm_engine import LLMEngine
from common.grpc_server import add_health, add_reflection, set_serving
from common.node import Heartbeat, default_host, engine_kwargs, make_node_info
from decode_node.service import DecodeNodeServicer
from decode_node.worker import DecodeWorker
from prefill_node.main import add_arguments as add_common_arguments
from proto import internal_pb2, internal_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE = internal_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p)
    p.set_defaults(port=int(os.environ.get("PDSERVE_PORT", "50071")))
    p.add_argument(
        "--transfer-port",
        type=int,
        default=int(os.environ.get("PDSERVE_TRANSFER_PORT", "29600")),
        help="TCPStore port for KV-channel rendezvous with prefill nodes [PDSERVE_TRANSFER_PORT]",
    )


async def serve(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model (or PDSERVE_MODEL) is required")
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    engine = LLMEngine(config)
    engine.block_manager.enable_events()
    advertise = args.advertise_host or default_host()
    node_id = args.node_id or f"decode-{advertise}-{args.port}"
    thread = EngineThread(engine, name=f"engine-{node_id}").start()
    worker = DecodeWorker(
        node_id,
        thread,
        advertise,
        args.transfer_port,
        transfer_timeout_s=args.transfer_timeout,
        verify_transfers=args.verify_kv,
    )

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    internal_pb2_grpc.add_DecodeNodeServicer_to_server(DecodeNodeServicer(worker), server)
    health = add_health(server, [SERVICE])
    if args.enable_reflection:
        add_reflection(server, [SERVICE])
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()

    cluster = Cluster.from_url(args.redis_url, ttl_s=args.node_ttl)
    info = make_node_info(
        NodeRole.DECODE,
        node_id,
        f"{advertise}:{args.port}",
        config.served_model_name,
        config.kvcache_block_size,
        transfer_host=advertise,
        transfer_port=args.transfer_port,
    )
    heartbeat = Heartbeat(
        cluster, thread, info, interval_s=args.heartbeat_interval, counters=worker.stats.counters
    )
    await heartbeat.beat()
    beating = asyncio.create_task(heartbeat.run_forever())
    await set_serving(health, [SERVICE], True)
    logger.info(
        "decode node %s serving on %s:%d (KV rendezvous on %d)",
        node_id,
        args.host,
        args.port,
        args.transfer_port,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("decode node %s stopping", node_id)
    await set_serving(health, [SERVICE], False)
    beating.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await beating
    await heartbeat.deregister()
    await server.stop(grace=5)
    await worker.close()
    thread.stop()
    await cluster.close()
    return 0
