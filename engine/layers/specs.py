"""Plain descriptions the layers are built from: the attention backends' names,
the skinny-GEMM choice and the rotary embedding's configuration.

Torch-free on purpose: the engine's config parses these, and the router
validates requests with that config without importing torch.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass


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


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """One launch configuration of the skinny GEMM kernel (engine/layers/skinny_gemm.py)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False  # a 16-row tensor-core tile (8..16 tokens)

    def to_dict(self) -> dict[str, int | bool]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GemvConfig:
        return cls(**d)


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
