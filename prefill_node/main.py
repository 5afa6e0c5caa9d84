"""`pdserve prefill`: run one prefill node."""

from __future__ import annotations

import argparse
import os

from common.cluster.state import NodeRole
from common.kv_transfer import KVSender
from common.kv_transfer.protocol import MAX_GROUP
from common.runtime.config import NodeConfig, add_node_arguments, fault_delays
from common.runtime.node import run_node, start_node_engine
from common.runtime.ports import PlannedPort
from engine.config import DEFAULT_MAX_NUM_SEQS
from prefill_node.service import PrefillNodeServicer
from prefill_node.worker import PrefillWorker
from proto import internal_pb2, internal_pb2_grpc

SERVICE = internal_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name


# Layers per KV chunk: measured in docs/lab/2026-11-26-layer-wise-kv-streaming.md.
DEFAULT_KV_STREAM_LAYERS = 1
# Every layer streams unless told: holding the first layers pays only where
# the link sends them during the last layers' compute (NVLink between GPUs of
# one host, layers as heavy as an 8B model's), and there it shortened a long
# prompt's TTFT; over a slower link or with light layers it would leave the
# held chunk's transfer after the forward
# (docs/lab/2026-11-27-nvlink-power-and-the-forward.md).
DEFAULT_KV_STREAM_LAST_LAYERS = 0


def _layers(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_node_arguments(p, default_port=50061)
    p.add_argument(
        "--kv-stream-layers",
        type=_layers,
        default=os.environ.get("PDSERVE_KV_STREAM_LAYERS") or DEFAULT_KV_STREAM_LAYERS,
        help="stream a prompt's KV to the decode node in chunks of this many layers, each "
        "sent as soon as its layers ran; 0: one chunk per prefill step, after its last "
        f"layer (default {DEFAULT_KV_STREAM_LAYERS}) [PDSERVE_KV_STREAM_LAYERS]",
    )
    p.add_argument(
        "--kv-stream-last-layers",
        type=_layers,
        default=os.environ.get("PDSERVE_KV_STREAM_LAST_LAYERS") or DEFAULT_KV_STREAM_LAST_LAYERS,
        help="stream only a prompt's last N layers that way; the KV of the layers before "
        "them goes as one chunk once they ran, so that NVLink is active only at the end of "
        "the forward, where the link's active power state costs the matmuls throughput; only "
        "where the link sends that chunk within the last N layers' compute; 0: every layer "
        f"streamed (default {DEFAULT_KV_STREAM_LAST_LAYERS}) [PDSERVE_KV_STREAM_LAST_LAYERS]",
    )


def check_group_room(args: argparse.Namespace) -> None:
    """A step's KV headers to one decode rank travel as one group of at most
    MAX_GROUP: one segment per request, two with held layers."""
    seqs = args.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    per_request = 2 if args.kv_stream_last_layers else 1
    if seqs * per_request > MAX_GROUP:
        raise ValueError(
            f"--max-num-seqs {seqs} with {per_request} KV segment(s) per request and step "
            f"exceeds the {MAX_GROUP} a KV group carries: lower --max-num-seqs"
            + (" or stream every layer (--kv-stream-last-layers 0)" if per_request > 1 else "")
        )


async def serve(args: argparse.Namespace) -> int:
    config = NodeConfig.from_args(args)
    check_group_room(args)
    # A prefill node never produces text, but it loads the tokenizer (unless
    # --skip-tokenizer-init) for structured outputs: it samples a structured
    # request's first token under the grammar, which is compiled for the
    # tokenizer's vocabulary.
    ports = [PlannedPort(config.port, "--port", "prefill node gRPC API")]
    node = start_node_engine(
        config,
        NodeRole.PREFILL,
        ports,
        worker_extension_cls="prefill_node.tp_rank:PrefillRank",
    )
    faults = fault_delays(node.node_id)
    sender = KVSender(
        node.node_id,
        node.engine.model_runner.device,
        timeout_s=config.transfer_timeout_s,
        connect_timeout_s=config.kv_connect_timeout_s,
        faults=faults,
    )
    worker = PrefillWorker(
        node.node_id,
        node.thread,
        sender,
        verify_transfers=config.verify_kv,
        max_queued=config.max_queued_requests,
        faults=faults,
        layers_per_chunk=args.kv_stream_layers,
        last_layers=args.kv_stream_last_layers,
        tracing=node.tracing,
        adapters=node.adapters,
    )

    async def close() -> None:
        sender.close()
        node.tracing.shutdown()

    return await run_node(
        config,
        service=SERVICE,
        add_servicer=lambda s: internal_pb2_grpc.add_PrefillNodeServicer_to_server(
            PrefillNodeServicer(worker), s
        ),
        thread=node.thread,
        adapters=node.adapters,
        info=node.info(NodeRole.PREFILL, config.port),
        counters=worker.stats.counters,
        close=close,
        histograms=worker.stats.histograms,
    )
