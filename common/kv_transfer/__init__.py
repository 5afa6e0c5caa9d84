"""KV transfer between a prefill node and a decode node (docs/architecture.md, "KV transfer").

One pairwise process group per (prefill, decode) pair, built directly from a
TCPStore rendezvous that the decode node hosts: gloo on CPU, NCCL on CUDA, the
same code. A transfer is a fixed-size header followed by one contiguous payload
(all of a request's blocks, every layer, K and V), never one message per block.
Senders and receivers run on their own threads (and CUDA streams), every
operation has a deadline, and a channel that fails is closed and rebuilt under
a new epoch on next use.
"""

from common.kv_transfer.channel import PairChannel, TransferError
from common.kv_transfer.protocol import TransferHeader, TransferState
from common.kv_transfer.receiver import KVReceiver
from common.kv_transfer.sender import Destination, KVSender

__all__ = [
    "Destination",
    "KVReceiver",
    "KVSender",
    "PairChannel",
    "TransferError",
    "TransferHeader",
    "TransferState",
]
