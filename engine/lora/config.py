"""The engine's LoRA options (vLLM's names, flat on EngineConfig as vLLM's
engine arguments are) and their checks. Torch-free."""

from __future__ import annotations

import enum

# vLLM's allowed ranks (its MaxLoRARanks): device slots are sized by the maximum.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The projections an adapter may target (PEFT's module names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRADType(enum.Enum):
    """``lora_dtype``: the adapters' device dtype ("auto": the model's)."""

    AUTO = "auto"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


def check_lora_options(
    enable_lora: bool,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    tensor_parallel_size: int,
    fully_sharded_loras: bool,
) -> int:
    """Raise naming the field when the options are inconsistent; returns the
    effective ``max_cpu_loras`` (vLLM's default: ``max_loras``)."""
    if not isinstance(max_loras, int) or isinstance(max_loras, bool) or max_loras < 1:
        raise ValueError(f"max_loras must be an integer >= 1; got {max_loras!r}")
    if max_lora_rank not in MAX_LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {MAX_LORA_RANKS}; got {max_lora_rank!r}")
    if max_cpu_loras is None:
        max_cpu_loras = max_loras
    if not isinstance(max_cpu_loras, int) or isinstance(max_cpu_loras, bool):
        raise ValueError(f"max_cpu_loras must be an integer; got {max_cpu_loras!r}")
    if max_cpu_loras < max_loras:
        raise ValueError(
            f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}): every "
            "adapter in a device slot is also held in host memory"
        )
    if enable_lora and fully_sharded_loras and tensor_parallel_size > 1:
        raise ValueError(
            "fully_sharded_loras is not implemented: adapters are sharded like their base "
            "layers (B of column-parallel, A of row-parallel projections); leave it False"
        )
    return max_cpu_loras
