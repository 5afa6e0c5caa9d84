"""The gated MLP's activation over the fused gate/up output: ``act(gate) * up``.

SwiGLU (``silu``, Llama/Qwen/Mistral and every supported MoE) or GeGLU with
the tanh approximation of GELU (``gelu_pytorch_tanh``, Gemma).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused  # one Triton kernel instead of three torch ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from engine.layers.fused_kernels import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def gated_activation(hidden_act: str, fused: bool = False) -> nn.Module:
    """The module for config.json's activation name (engine/models/families.py
    lists the supported ones)."""
    if hidden_act == "silu":
        return SiluAndMul(fused)
    if hidden_act == "gelu_pytorch_tanh":
        return GeluTanhAndMul()
    raise ValueError(f"unsupported activation {hidden_act!r}; supported: silu, gelu_pytorch_tanh")
