"""The gated MLP (``down(act(gate(x)) * up(x))``), with gate and up fused.

Column-parallel gate/up and row-parallel down under tensor parallelism: each
rank holds ``intermediate`` of the rows (engine/tp_layout.py), and the
all-reduce after down sums the ranks' partial outputs. A caller that sums
several partial outputs first (an MoE layer with a shared expert) passes
``reduce=False`` and reduces once.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.activation import gated_activation
from engine.layers.skinny_gemm import SkinnyLinear
from engine.parallel.group import TPGroup


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate: int,  # this rank's share
        tp: TPGroup,
        bias: bool = False,
        hidden_act: str = "silu",
        fused: bool = False,
        reduce: bool = True,
        linear: type[nn.Module] = SkinnyLinear,  # the projections' class (FP8: Fp8Linear)
    ) -> None:
        super().__init__()
        self.gate_up_proj = linear(hidden_size, 2 * intermediate, bias=bias)
        # Row-parallel; its bias is loaded on rank 0 only (zero elsewhere), so the
        # all-reduce adds it once.
        self.down_proj = linear(intermediate, hidden_size, bias=bias)
        self.act = gated_activation(hidden_act, fused)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return self.tp.all_reduce(out) if self.reduce else out
