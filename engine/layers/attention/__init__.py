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
from engine.models.config import ModelArchConfig

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
    model: ModelArchConfig | None = None,
    fp8_kv: bool = False,
) -> type[AttentionBackend]:
    """The backend class to run ``model``: one that lacks a feature its layers need
    (a sliding window, soft-capped scores) or the cache needs (``fp8_kv``: an
    FP8 KV cache) is refused, or skipped by auto."""
    sliding_window = model is not None and model.sliding_window is not None
    soft_cap = model is not None and model.attn_logit_softcapping is not None

    def reason_against(cls: type[AttentionBackend]) -> str | None:
        if fp8_kv and not cls.supports_fp8_kv:
            return "it does not read an FP8 KV cache"
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
