"""SiLU-and-multiply for the fused gate/up projection of SwiGLU MLPs."""

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
