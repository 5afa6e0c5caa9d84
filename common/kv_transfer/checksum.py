"""The KV payload checksum (``--verify-kv``): both nodes compute it the same way."""

from __future__ import annotations

import hashlib

import torch


def checksum(data: torch.Tensor) -> bytes:
    """BLAKE2b-128 of a tensor's bytes."""
    raw = data.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()
