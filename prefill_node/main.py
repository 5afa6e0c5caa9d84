"""`pdserve prefill`: run one prefill node."""

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
from common.kv_transfer import KVSender
from common.node import Heartbeat, add_engine_flags, default_host, engine_kwargs, make_node_info
from prefill_node.service import PrefillNodeServicer
from prefill_node.worker import PrefillWorker
from proto import internal_pb2, internal_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE = internal_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name


def add_arguments(p: argparse.ArgumentParser) -> None:
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
        default=int(env("PDSERVE_PORT", "50061")),
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
    p.add_argument("--node-ttl", type=float, default=float(env("PDSERVE_NODE_TTL_S", "5")))
    p.add_argument(
        "--transfer-timeout", type=float, default=float(env("PDSERVE_TRANSFER_TIMEOUT_S", "30"))
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
    add_engine_flags(p)


async def serve(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model (or PDSERVE_MODEL) is required")
    # A prefill node never produces text: no tokenizer to load.
    kwargs = engine_kwargs(args) | {"skip_tokenizer_init": True}
    config = EngineConfig.from_kwargs(args.model, **kwargs)
    engine = LLMEngine(config)
    engine.block_manager.enable_events()
    advertise = args.advertise_host or default_host()
    node_id = args.node_id or f"prefill-{advertise}-{args.port}"
    thread = EngineThread(engine, name=f"engine-{node_id}").start()
    sender = KVSender(node_id, engine.model_runner.device, timeout_s=args.transfer_timeout)
    worker = PrefillWorker(node_id, thread, sender, verify_transfers=args.verify_kv)

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    internal_pb2_grpc.add_PrefillNodeServicer_to_server(PrefillNodeServicer(worker), server)
    health = add_health(server, [SERVICE])
    if args.enable_reflection:
        add_reflection(server, [SERVICE])
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()

    cluster = Cluster.from_url(args.redis_url, ttl_s=args.node_ttl)
    info = make_node_info(
        NodeRole.PREFILL,
        node_id,
        f"{advertise}:{args.port}",
        config.served_model_name,
        config.kvcache_block_size,
    )
    heartbeat = Heartbeat(
        cluster, thread, info, interval_s=args.heartbeat_interval, counters=worker.stats.counters
    )
    await heartbeat.beat()  # registered before we say SERVING
    beating = asyncio.create_task(heartbeat.run_forever())
    await set_serving(health, [SERVICE], True)
    logger.info("prefill node %s serving on %s:%d", node_id, args.host, args.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("prefill node %s stopping", node_id)
    await set_serving(health, [SERVICE], False)
    beating.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await beating
    await heartbeat.deregister()
    await server.stop(grace=5)
    sender.close()
    thread.stop()
    await cluster.close()
    return 0
