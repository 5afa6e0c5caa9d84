"""Attention backends and their selection.

``attention_backend="auto"`` picks, on CUDA, flash_attn (FlashAttention-4 or -2)
when it is importable, else our triton kernels; on the CPU, torch. The choice is
logged once, and a backend that cannot run says why in one line.
"""

from __future__ import annotations

import logging

import torch

from engine.layers.attention.backend import (
    AttentionBackend,
    AttentionBackendName,
    AttentionMetadata,
)
from engine.layers.attention.torch_backend import TorchAttention

logger = logging.getLogger(__name__)

__all__ = [
    "AttentionBackend",
    "AttentionBackendName",
    "AttentionMetadata",
    "TorchAttention",
    "select_backend",
]

_AUTO_ORDER_CUDA = (
    AttentionBackendName.FLASH_ATTN,
    AttentionBackendName.TRITON,
    AttentionBackendName.TORCH,
)


def backend_class(name: AttentionBackendName) -> type[AttentionBackend]:
    # Imported lazily: the GPU backends pull in triton / flash_attn.
    if name is AttentionBackendName.TRITON:
        from engine.layers.attention.triton_backend import TritonAttention

        return TritonAttention
    if name is AttentionBackendName.FLASH_ATTN:
        from engine.layers.attention.flash_attn_backend import FlashAttention

        return FlashAttention
    return TorchAttention


def select_backend(
    name: AttentionBackendName,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: bool = False,
    soft_cap: bool = False,
) -> type[AttentionBackend]:
    """The backend class to run; ``sliding_window`` / ``soft_cap``: the model has
    layers that need them (a backend lacking them is refused, or skipped by auto)."""

    def reason_against(cls: type[AttentionBackend]) -> str | None:
        return cls.unavailable_reason(device, dtype) or cls.missing_features(
            sliding_window, soft_cap
        )

    if name is not AttentionBackendName.AUTO:
        cls = backend_class(name)
        reason = reason_against(cls)
        if reason is not None:
            raise ValueError(f"attention_backend {name.value!r} cannot run on {device}: {reason}")
        logger.info("attention backend: %s", cls.name.value)
        return cls
    if device.type != "cuda":
        logger.info("attention backend: torch (auto, device %s)", device)
        return TorchAttention
    skipped = []
    for candidate in _AUTO_ORDER_CUDA:
        cls = backend_class(candidate)
        reason = reason_against(cls)
        if reason is None:
            note = f"; not {', '.join(skipped)}" if skipped else ""
            logger.info("attention backend: %s (auto%s)", cls.name.value, note)
            return cls
        skipped.append(f"{candidate.value} ({reason})")
    raise RuntimeError(f"no attention backend runs on {device}")  # pragma: no cover
