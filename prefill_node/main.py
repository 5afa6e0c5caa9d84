"""`pdserve prefill`: run one prefill node."""

from __future__ import annotations

import argparse

from common.cluster import NodeInfo, NodeRole
from common.engine.config import EngineConfig
from common.engine.engine_thread import EngineThread
from common.engine.llm_engine import LLMEngine
from common.kv_transfer import KVSender
from common.node import add_node_arguments, default_host, engine_kwargs, fault_delays, run_node
from common.ports import PlannedPort, check_free
from common.redis_auth import redis_options_from_args
from common.tls import TLSConfig
from prefill_node.service import PrefillNodeServicer
from prefill_node.worker import PrefillWorker
from proto import internal_pb2, internal_pb2_grpc

SERVICE = internal_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p, default_port=50061)


async def serve(args: argparse.Namespace) -> int:
    if not args.model:
        raise ValueError("--model (or PDSERVE_MODEL) is required")
    # Bad TLS or Redis flags fail now, not after loading the model.
    TLSConfig.from_args(args)
    redis_options_from_args(args)
    check_free(args.host, [PlannedPort(args.port, "--port", "prefill node gRPC API")])
    # A prefill node never produces text: no tokenizer to load.
    kwargs = engine_kwargs(args) | {"skip_tokenizer_init": True}
    config = EngineConfig.from_kwargs(args.model, **kwargs)
    engine = LLMEngine(config)
    engine.block_manager.enable_events()
    advertise = args.advertise_host or default_host()
    node_id = args.node_id or f"prefill-{advertise}-{args.port}"
    thread = EngineThread(engine, name=f"engine-{node_id}").start()
    faults = fault_delays(node_id)
    sender = KVSender(
        node_id, engine.model_runner.device, timeout_s=args.transfer_timeout, faults=faults
    )
    worker = PrefillWorker(
        node_id,
        thread,
        sender,
        verify_transfers=args.verify_kv,
        max_queued=args.max_queued_requests,
        faults=faults,
    )
    info = NodeInfo(
        node_id=node_id,
        role=NodeRole.PREFILL,
        address=f"{advertise}:{args.port}",
        model_id=config.served_model_name,
        block_size=config.kvcache_block_size,
        max_num_seqs=config.max_num_seqs,
    )

    async def close() -> None:
        sender.close()

    return await run_node(
        args,
        service=SERVICE,
        add_servicer=lambda s: internal_pb2_grpc.add_PrefillNodeServicer_to_server(
            PrefillNodeServicer(worker), s
        ),
        thread=thread,
        info=info,
        counters=worker.stats.counters,
        close=close,
        histograms=worker.stats.histograms,
    )
