"""Plain descriptions the layers are built from: the attention backends' names,
the skinny-GEMM choice and the rotary embedding's configuration.

Torch-free on purpose: the engine's config parses these, and the router
validates requests with that config without importing torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AttentionBackendName(enum.Enum):
    """``attention_backend`` in EngineConfig; a backend class's ``name``."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    FLASH_ATTN = "flash_attn"


class GemvBackend(enum.Enum):
    """``gemv_backend`` in EngineConfig: what multiplies a decode step's few tokens
    (1..16) by a projection's weight, on CUDA in bf16/fp16 (elsewhere: torch)."""

    AUTO = "auto"  # the skinny Triton kernel where it beats cuBLAS (tuned table, or measured)
    TRITON = "triton"  # the skinny kernel for every projection (tests, benchmarks)
    TORCH = "torch"  # F.linear (cuBLAS) always


class RopeType(enum.StrEnum):
    """HF config.json's ``rope_type`` values we implement."""

    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    rope_type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
