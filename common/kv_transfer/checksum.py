"""The KV checksum (``--verify-kv``): both nodes compute it the same way.

Each chunk is hashed on its own (the prefill node the bytes it gathered, the
decode node its blocks after the scatter, read back in the chunk's layout); a
request's checksum chains its chunks' digests in wire order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def checksum(data: torch.Tensor) -> bytes:
    """BLAKE2b-128 of a tensor's bytes."""
    raw = data.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(raw, digest_size=16).digest()


def chain(digests: Iterable[bytes]) -> bytes:
    """BLAKE2b-128 of the chunks' digests, in order: one value per request."""
    h = hashlib.blake2b(digest_size=16)
    for d in digests:
        h.update(d)
    return h.digest()
