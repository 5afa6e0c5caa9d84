"""`pdserve decode`: run one decode node."""

from __future__ import annotations

import argparse
import os

from common.cluster import NodeInfo, NodeRole
from common.engine.config import EngineConfig
from common.engine.engine_thread import EngineThread
from common.engine.llm_engine import LLMEngine
from common.node import add_node_arguments, default_host, engine_kwargs, fault_delays, run_node
from common.ports import PlannedPort, check_free
from common.redis_auth import redis_options_from_args
from common.tls import TLSConfig
from decode_node.service import DecodeNodeServicer
from decode_node.worker import DecodeWorker
from proto import internal_pb2, internal_pb2_grpc

SERVICE = internal_pb2.DESCRIPTOR.services_by_name["DecodeNode"].full_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p, default_port=50071)
    p.add_argument(
        "--transfer-port",
        type=int,
        default=int(os.environ.get("PDSERVE_TRANSFER_PORT", "29600")),
        help="TCPStore port for KV-channel rendezvous with prefill nodes [PDSERVE_TRANSFER_PORT]",
    )
    p.add_argument(
        "--kv-lease",
        type=float,
        default=float(os.environ.get("PDSERVE_KV_LEASE_S", "30")),
        help="seconds a prefill node gets to fill a KV reservation before it is reclaimed "
        "and the request retried elsewhere [PDSERVE_KV_LEASE_S]",
    )


async def serve(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model (or PDSERVE_MODEL) is required")
    # Bad TLS or Redis flags fail now, not after loading the model.
    tls = TLSConfig.from_args(args)
    redis_options_from_args(args)
    check_free(
        args.host,
        [
            PlannedPort(args.port, "--port", "decode node gRPC API"),
            PlannedPort(args.transfer_port, "--transfer-port", "KV transfer"),
        ],
    )
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
        kv_lease_s=args.kv_lease,
        max_queued=args.max_queued_requests,
        faults=fault_delays(node_id),
        tls=tls,
    )
    # Prefill nodes open their KV channel to transfer_host:transfer_port.
    info = NodeInfo(
        node_id=node_id,
        role=NodeRole.DECODE,
        address=f"{advertise}:{args.port}",
        model_id=config.served_model_name,
        block_size=config.kvcache_block_size,
        max_num_seqs=config.max_num_seqs,
        transfer_host=advertise,
        transfer_port=args.transfer_port,
    )
    return await run_node(
        args,
        service=SERVICE,
        add_servicer=lambda s: internal_pb2_grpc.add_DecodeNodeServicer_to_server(
            DecodeNodeServicer(worker), s
        ),
        thread=thread,
        info=info,
        counters=worker.stats.counters,
        close=worker.close,
    )
