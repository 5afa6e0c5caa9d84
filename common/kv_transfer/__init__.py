"""KV transfer between a prefill node and a decode node (docs/architecture.md, "KV transfer").

One pairwise process group per (prefill, decode) pair, built directly from a
TCPStore rendezvous that the decode node hosts: gloo on CPU, NCCL on CUDA, the
same code. The prefill node streams a request's KV as it computes it: per
prefill step a segment of blocks, sent in chunks of a few layers each as soon
as those layers ran (protocol.py has the wire format and the ordering rule).
Senders and receivers run on their own threads (and CUDA streams), every
operation has a deadline, and a channel that fails is closed and rebuilt under
a new epoch on next use.
"""

from common.kv_transfer.channel import DeadlinePassed, PairChannel, TransferError
from common.kv_transfer.protocol import ChunkDesc, SegmentHeader, TransferState, wire_order
from common.kv_transfer.receiver import KVReceiver, KVSink
from common.kv_transfer.sender import KVSender
from common.kv_transfer.ticket import (
    Destination,
    OutgoingSegment,
    TransferReport,
    TransferTicket,
)

__all__ = [
    "ChunkDesc",
    "DeadlinePassed",
    "Destination",
    "KVReceiver",
    "KVSender",
    "KVSink",
    "OutgoingSegment",
    "PairChannel",
    "SegmentHeader",
    "TransferError",
    "TransferReport",
    "TransferState",
    "TransferTicket",
    "wire_order",
]
