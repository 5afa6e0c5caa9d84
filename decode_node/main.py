"""`pdserve decode`: run one decode node."""

from __future__ import annotations

import argparse
import json
import os

from common.cluster.state import NodeRole
from common.runtime.config import NodeConfig, add_node_arguments, fault_delays
from common.runtime.node import run_node, start_node_engine
from common.runtime.ports import PlannedPort
from decode_node.service import DecodeNodeServicer
from decode_node.worker import DecodeWorker
from engine.spec_decode.config import SpeculativeConfig
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

    p.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        # A string default goes through `type`: a bad value is reported like a bad flag.
        default=os.environ.get("PDSERVE_SPECULATIVE_CONFIG") or None,
        help="speculative decoding, vLLM's JSON form, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\' '
        "(docs/engine.md; steps run synchronously with it) [PDSERVE_SPECULATIVE_CONFIG]",
    )


def speculative_config_arg(value: str) -> dict:
    """The flag's JSON, checked now so a bad one fails before the model loads."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    try:
        return SpeculativeConfig.parse(parsed).to_dict()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


async def serve(args: argparse.Namespace) -> int:
    config = NodeConfig.from_args(args)
    # Decode nodes only: a prefill node samples one token per request.
    spec = {"speculative_config": args.speculative_config} if args.speculative_config else {}
    ports = [
        PlannedPort(config.port, "--port", "decode node gRPC API"),
        PlannedPort(args.transfer_port, "--transfer-port", "KV transfer"),
    ]
    node = start_node_engine(
        config,
        NodeRole.DECODE,
        ports,
        worker_extension_cls="decode_node.tp_rank:DecodeRank",
        **spec,
    )
    worker = DecodeWorker(
        node.node_id,
        node.thread,
        node.advertise_host,
        args.transfer_port,
        transfer_timeout_s=config.transfer_timeout_s,
        connect_timeout_s=config.kv_connect_timeout_s,
        verify_transfers=config.verify_kv,
        kv_lease_s=args.kv_lease,
        max_queued=config.max_queued_requests,
        faults=fault_delays(node.node_id),
        tls=config.tls,
        tracing=node.tracing,
        adapters=node.adapters,
    )
    # Prefill nodes open their KV channel to transfer_host:transfer_port.
    info = node.info(
        NodeRole.DECODE,
        config.port,
        transfer_host=node.advertise_host,
        transfer_port=args.transfer_port,
    )

    async def close() -> None:
        await worker.close()
        node.tracing.shutdown()

    return await run_node(
        config,
        service=SERVICE,
        add_servicer=lambda s: internal_pb2_grpc.add_DecodeNodeServicer_to_server(
            DecodeNodeServicer(worker), s
        ),
        thread=node.thread,
        adapters=node.adapters,
        info=info,
        counters=worker.stats.counters,
        histograms=worker.stats.histograms,
        close=close,
    )
