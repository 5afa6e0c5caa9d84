"""Attention backends and their selection.

``attention_backend="auto"`` picks the fastest backend that runs on the device;
the choice is logged once. Backends that are not available say why in one line.
"""

from __future__ import annotations

import logging

import torch

from common.engine.config import AttentionBackendName
from common.layers.attention.backend import AttentionBackend, AttentionMetadata
from common.layers.attention.torch_backend import TorchAttention

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttention", "select_backend"]


def _backend_class(name: AttentionBackendName) -> type[AttentionBackend] | None:
    if name is AttentionBackendName.TORCH:
        return TorchAttention
    return None


def select_backend(name: AttentionBackendName, device: torch.device) -> type[AttentionBackend]:
    if name is AttentionBackendName.AUTO:
        # GPU backends (triton, flash_attn) join this list in the GPU issue.
        candidates = [AttentionBackendName.TORCH]
        for candidate in candidates:
            cls = _backend_class(candidate)
            if cls is not None and cls.unavailable_reason(device) is None:
                logger.info("attention backend: %s (auto, device %s)", cls.name, device)
                return cls
        raise RuntimeError(f"no attention backend runs on {device}")  # pragma: no cover
    cls = _backend_class(name)
    if cls is None:
        raise ValueError(
            f"attention_backend {name.value!r} is not available in this build; "
            "available: 'auto', 'torch'"
        )
    reason = cls.unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention_backend {name.value!r} cannot run on {device}: {reason}")
    logger.info("attention backend: %s", cls.name)
    return cls
