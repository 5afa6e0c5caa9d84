"""Batched LoRA over per-token adapter slots (the punica design), torch form.

A step's tokens belong to sequences of different adapters (or none). Each
token carries its slot (``token_slots``, -1: the base model only), and every
LoRA projection runs two batched products over the stacked slot weights:

- shrink: ``u[t] = x[t] @ A[slot[t]].T`` (``A``: ``[max_loras, R, in]``; the
  A of a fused projection's slices stacked along R, so one shrink serves q, k
  and v), accumulated in fp32;
- expand: ``y[t, off:off+n] += u[t, r0:r0+R] @ B[slot[t]].T`` per slice
  (``B``: ``[max_loras, n, R]``, the scaling folded in).

Ranks below ``R`` are zero-padded, so every slot has one shape and an unused
slice of a slot adds zeros. This module is the CPU path and the reference the
Triton kernels (engine/lora/punica_triton.py) are tested against: it groups
rows by slot on the host (``segments``) and runs one matmul per slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class LoRABatch:
    """One step's adapter rows. ``token_slots`` (int32 ``[T]``, device) feeds the
    Triton kernels; ``segments`` ((slot, int64 row indices) per adapter in the
    step, device) the torch path."""

    token_slots: torch.Tensor
    segments: tuple[tuple[int, torch.Tensor], ...]
    use_triton: bool = False

    @classmethod
    def build(cls, slots: np.ndarray, slots_dev: torch.Tensor, use_triton: bool) -> LoRABatch:
        """From the per-token slots (int32 ``[T]``) on the host and the device."""
        segments = []
        if not use_triton:
            for slot in np.unique(slots[slots >= 0]).tolist():
                rows = torch.from_numpy(np.flatnonzero(slots == slot))
                segments.append((slot, rows.to(slots_dev.device)))
        return cls(slots_dev, tuple(segments), use_triton)


def shrink(x: torch.Tensor, a: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """fp32 ``[T, R]``: each token's ``x @ A[slot].T`` (zeros for slot -1)."""
    if batch.use_triton:
        from engine.lora.punica_triton import shrink_triton

        return shrink_triton(x, a, batch.token_slots)
    u = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in batch.segments:
        u.index_copy_(0, rows, x.index_select(0, rows).float() @ a[slot].float().T)
    return u


def expand(
    y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, batch: LoRABatch, offset: int
) -> None:
    """``y[:, offset:offset + n] += u @ B[slot].T`` per token, in place (``u``:
    the slice's ``[T, R]`` columns of ``shrink``'s output)."""
    if batch.use_triton:
        from engine.lora.punica_triton import expand_triton

        expand_triton(y, u, b, batch.token_slots, offset)
        return
    out = y.narrow(-1, offset, b.shape[1])
    for slot, rows in batch.segments:
        delta = u.index_select(0, rows) @ b[slot].float().T
        out.index_add_(0, rows, delta.to(y.dtype))
