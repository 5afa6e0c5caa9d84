"""In-process KV transfer between two engines: unit tests only.

Integration tests and production use real gloo / NCCL channels between
processes (sender.py, receiver.py); this moves the same bytes with no
channel, so engine-level tests of the prefill/decode hand-off stay fast.
"""

from __future__ import annotations

import torch

from common.kv_transfer.checksum import checksum


def loopback_transfer(
    prefill_runner, src_blocks: list[int], decode_runner, dst_blocks: list[int]
) -> bytes:
    """Copy blocks from one engine's cache to another's; returns the payload's checksum."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError("source and destination block counts differ")
    if not src_blocks:
        return checksum(torch.empty(0))
    payload = prefill_runner.gather_kv(src_blocks)
    decode_runner.scatter_kv(dst_blocks, payload.view(-1).view(torch.uint8))
    return checksum(payload)
