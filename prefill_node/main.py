"""`pdserve prefill`: run one prefill node."""

from __future__ import annotations

import argparse
import os

from common.cluster import NodeRole
from common.kv_transfer import KVSender
from common.node import run_node, start_node_engine
from common.node_flags import add_node_arguments, fault_delays
from common.ports import PlannedPort
from prefill_node.service import PrefillNodeServicer
from prefill_node.worker import PrefillWorker
from proto import internal_pb2, internal_pb2_grpc

SERVICE = internal_pb2.DESCRIPTOR.services_by_name["PrefillNode"].full_name


# Layers per KV chunk: measured in docs/performance.md ("Layer-wise KV streaming").
DEFAULT_KV_STREAM_LAYERS = 1
# On a GPU only the last 4 layers stream, the ones before go as one chunk:
# NVLink kept active over the whole forward costs a power-capped GPU about 2% of
# its clock (docs/performance.md, "NVLink's power and the forward"). On a CPU
# every layer streams: gloo has no such cost, and a CPU's gathers and
# scatters are slow enough that spreading them over the forward pays.
GPU_KV_STREAM_LAST_LAYERS = 4


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
        default=os.environ.get("PDSERVE_KV_STREAM_LAST_LAYERS") or None,
        help="stream only a prompt's last N layers that way; the KV of the layers before "
        "them goes as one chunk once they ran, so that the link between the nodes is active "
        f"only at the end of the forward; 0: every layer streamed (default "
        f"{GPU_KV_STREAM_LAST_LAYERS} on a GPU, 0 on a CPU) [PDSERVE_KV_STREAM_LAST_LAYERS]",
    )


async def serve(args: argparse.Namespace) -> int:
    # A prefill node never produces text: no tokenizer to load.
    ports = [PlannedPort(args.port, "--port", "prefill node gRPC API")]
    node = start_node_engine(
        args,
        NodeRole.PREFILL,
        ports,
        skip_tokenizer_init=True,
        worker_extension_cls="prefill_node.tp_rank:PrefillRank",
    )
    faults = fault_delays(node.node_id)
    last_layers = args.kv_stream_last_layers
    if last_layers is None:
        on_gpu = node.engine.model_runner.device.type == "cuda"
        last_layers = GPU_KV_STREAM_LAST_LAYERS if on_gpu else 0
    sender = KVSender(
        node.node_id,
        node.engine.model_runner.device,
        timeout_s=args.transfer_timeout,
        faults=faults,
    )
    worker = PrefillWorker(
        node.node_id,
        node.thread,
        sender,
        verify_transfers=args.verify_kv,
        max_queued=args.max_queued_requests,
        faults=faults,
        layers_per_chunk=args.kv_stream_layers,
        last_layers=last_layers,
    )

    async def close() -> None:
        sender.close()

    return await run_node(
        args,
        service=SERVICE,
        add_servicer=lambda s: internal_pb2_grpc.add_PrefillNodeServicer_to_server(
            PrefillNodeServicer(worker), s
        ),
        thread=node.thread,
        info=node.info(NodeRole.PREFILL, args.port),
        counters=worker.stats.counters,
        close=close,
        histograms=worker.stats.histograms,
    )
