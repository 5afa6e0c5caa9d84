"""The transfer header: 16 int64 words sent before every payload. No pickle on the wire."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

MAGIC = 0x7064_7376_6B76_0001  # "pdsvkv", format 1
HEADER_WORDS = 16


class TransferState(enum.Enum):
    """Where one request's KV transfer stands (tracked by both nodes)."""

    RESERVED = enum.auto()  # decode node: blocks reserved, prefill requested
    SENDING = enum.auto()  # prefill node: header and payload on the wire
    LANDED = enum.auto()  # decode node: payload scattered into the reserved blocks
    COMMITTED = enum.auto()  # decode node: the sequence joined the running batch
    FAILED = enum.auto()  # channel error or deadline: blocks freed on both sides
    ABORTED = enum.auto()  # cancelled: blocks freed on both sides
    EXPIRED = enum.auto()  # decode node: the reservation's lease ran out


@dataclass(slots=True, frozen=True)
class TransferHeader:
    reservation_id: int  # chosen by the decode node, names the reserved blocks
    num_blocks: int  # blocks in the payload
    num_bytes: int  # payload size
    first_token: int  # the token the prefill node sampled
    checksum: bytes = bytes(16)  # BLAKE2b-128 of the payload, or zeros when not verified

    def to_tensor(self) -> torch.Tensor:
        words = [
            MAGIC,
            self.reservation_id,
            self.num_blocks,
            self.num_bytes,
            self.first_token,
            int.from_bytes(self.checksum[:8], "little", signed=True),
            int.from_bytes(self.checksum[8:], "little", signed=True),
        ]
        return torch.tensor(words + [0] * (HEADER_WORDS - len(words)), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TransferHeader:
        words = t.tolist()
        if len(words) != HEADER_WORDS or words[0] != MAGIC:
            raise ValueError(f"not a KV transfer header (magic {words[0]:#x})")
        checksum = words[5].to_bytes(8, "little", signed=True) + words[6].to_bytes(
            8, "little", signed=True
        )
        return cls(words[1], words[2], words[3], words[4], checksum)
