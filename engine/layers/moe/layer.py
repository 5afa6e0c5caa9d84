"""A mixture-of-experts MLP: router, routed experts, optional shared expert.

``router(x)`` gives each token's expert logits; the top k experts (softmax,
renormalised where the family does: engine/layers/moe/routing.py) each run
their gated MLP on the token, and the outputs are summed by routing weight.
Qwen2-MoE adds a shared expert every token runs, scaled by
``sigmoid(shared_expert_gate(x))``.

The experts' weights are stacked, ``w13_weight`` [E, 2I, H] (gate rows then
up rows) and ``w2_weight`` [E, H, I], so one Triton launch per projection
serves every expert (fused_moe.py) on CUDA; elsewhere the torch loop of
reference.py runs. Under tensor parallelism each rank holds every expert's
``I / t`` slice (and the shared expert's), and one all-reduce sums the routed
and shared parts together.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.mlp import GatedMLP
from engine.layers.moe.configs import MoeKernelConfig, config_for
from engine.layers.moe.reference import reference_experts
from engine.layers.moe.routing import select_experts
from engine.layers.skinny_gemm import SkinnyLinear
from engine.parallel.group import TPGroup


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate: int,  # one expert's, this rank's share
        tp: TPGroup,
        renormalize: bool,
        shared_intermediate: int = 0,  # this rank's share; 0: no shared expert
        fused_ops: bool = False,
        use_triton: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.router = SkinnyLinear(hidden_size, num_experts, bias=False)  # replicated
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate))
        self.shared_expert = None
        self.shared_expert_gate = None
        if shared_intermediate:
            self.shared_expert = GatedMLP(
                hidden_size, shared_intermediate, tp, fused=fused_ops, reduce=False
            )
            self.shared_expert_gate = SkinnyLinear(hidden_size, 1, bias=False)
        self.act = SiluAndMul(fused_ops)
        self.tp = tp
        # The Triton kernel (CUDA, or Triton's interpreter in tests) or the torch loop.
        self.use_triton = use_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        if self.use_triton:
            from engine.layers.moe.dispatch import fused_topk

            weights, ids = fused_topk(logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(logits, self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for routing ``weights`` / ``ids`` [T, k]."""
        if not self.use_triton:
            return reference_experts(x, self.w13_weight, self.w2_weight, weights, ids, self.act)
        from engine.layers.moe.fused_moe import fused_experts

        config = self.kernel_config(x.shape[0])
        return fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, config, self.act)

    def kernel_config(self, num_tokens: int) -> MoeKernelConfig:
        """The fused kernel's launch config for a step of ``num_tokens`` tokens."""
        w = self.w13_weight
        e, n2, k = w.shape
        name, dtype = _device_name(w.device), _dtype_key(w.dtype)
        return _config(name, dtype, num_tokens, e, n2 // 2, k, self.top_k)


@functools.lru_cache(maxsize=4096)
def _config(device_name, dtype, num_tokens, e, n, k, top_k) -> MoeKernelConfig:
    return config_for(device_name, dtype, num_tokens, e, n, k, top_k)


@functools.cache
def _device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
