"""Skinny GEMM: ``y = x @ W.T + b`` for a handful of tokens, as one Triton kernel.

A decode step at batch 1..16 turns every projection into a matrix-vector (or
matrix-few-vectors) product: it reads the whole weight once and does almost
no arithmetic, so it should run at HBM bandwidth. cuBLAS's kernels for these
shapes stay well below it for a small model's projections of a few MB
(docs/lab/2026-11-24-host-work-and-batch1-step.md): at that size each launch is mostly
latency. This kernel gives each program ``BLOCK_N`` rows of ``W`` (and, with
``SPLIT_K > 1``, a share of ``K``, summed by a second tiny kernel), streams
them through in ``BLOCK_K``-wide tiles and multiplies them with the few rows
of ``x``: by FMAs for up to 4 tokens, by a 16-row tensor-core ``tl.dot``
above. Accumulation is fp32 and the output is rounded once, as cuBLAS does.

The kernels are in engine/layers/skinny_gemm_kernels.py (this module imports
no triton). ``linear(x, weight, bias, plan)`` is the dispatcher every
projection goes through: a layer's ``GemvPlan`` (engine/layers/skinny_gemm_plan.py fills it on
CUDA, per weight shape and token count: the tuned table, else a measurement
against cuBLAS at load) names the config to use, and everything else (CPU,
fp32, more than ``MAX_M`` tokens, a shape where cuBLAS wins, no plan) is
``F.linear``. ``SkinnyLinear`` is ``nn.Linear`` routed through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.specs import GemvConfig

__all__ = [
    "FMA_MAX_M",
    "MAX_M",
    "M_BUCKETS",
    "GemvConfig",
    "GemvPlan",
    "SkinnyLinear",
    "bucket",
    "default_config",
    "linear",
]

MAX_M = 16  # the most tokens the kernel serves; beyond, cuBLAS's tiles win
# Token counts are planned in power-of-two buckets (the CUDA graphs' batch sizes).
M_BUCKETS = (1, 2, 4, 8, 16)
_BUCKET = [0] + [next(b for b in M_BUCKETS if b >= m) for m in range(1, MAX_M + 1)]
FMA_MAX_M = 4  # up to this many tokens multiply by FMAs; above, by tl.dot


@dataclass(slots=True)
class GemvPlan:
    """For one weight: the config per token-count bucket, None where cuBLAS is faster."""

    configs: dict[int, GemvConfig | None]

    def config_for(self, m: int) -> GemvConfig | None:
        if m < 1 or m > MAX_M:
            return None
        return self.configs.get(_BUCKET[m])


def bucket(m: int) -> int:
    """The planned bucket of ``m`` tokens (1 <= m <= MAX_M)."""
    return _BUCKET[m]


def default_config(m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """A config without tuning. Bandwidth needs many loads in flight, and a
    program has one or two at a time, so the FMA tiles are narrow and long
    (few rows, wide K) to give every SM two or more programs; K is split only
    where even the narrowest row blocks would leave half the SMs idle."""
    use_dot = m > FMA_MAX_M
    block_k = 128 if use_dot else (1024 if m == 1 else 512 if m == 2 else 256)
    widths = (64, 32, 16) if use_dot else (32, 16, 8, 4)
    block_n = next((w for w in widths if -(-n // w) >= 2 * num_sms), widths[-1])
    tiles = -(-n // block_n)
    split_k = 1
    while tiles * split_k < num_sms // 2 and k >= block_k * split_k * 4:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k, num_warps=4, num_stages=3, use_dot=use_dot)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """``F.linear`` through the skinny kernel where ``plan`` says it is faster.

    The plan exists only for CUDA weights in bf16/fp16 (``skinny_gemm_plan``);
    what it does not cover goes to ``F.linear``. Under a CUDA graph capture
    this runs once per graph, so the choice costs nothing at replay.
    """
    if plan is not None and x.dtype is weight.dtype:
        cfg = plan.config_for(x.numel() // x.shape[-1])
        if cfg is not None:
            # Imported here: this module stays importable without triton.
            from engine.layers.skinny_gemm_kernels import skinny_gemm

            return skinny_gemm(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


class SkinnyLinear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose forward is ``linear``.

    ``gemv_plan`` stays None (plain ``F.linear``) until the model runner plans the
    layer on a GPU. A layer of another kind routes through the kernel by the
    same two steps: set ``routes_through_skinny_gemm`` and call ``linear``.
    """

    routes_through_skinny_gemm = True
    gemv_plan: GemvPlan | None = None

    def reset_parameters(self) -> None:
        """No initial values: a model's loader (or its dummy init) writes every
        parameter and fails on one it did not, so nn.Linear's random init would
        be work thrown away, seconds of a node's start on a CPU host."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemv_plan)
