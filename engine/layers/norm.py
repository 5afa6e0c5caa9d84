"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        fused: bool = False,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        # Gemma stores its norm weights as w - 1 and multiplies by (1 + w), in
        # fp32 before rounding (Llama rounds the normalised x first).
        self.weight_offset = weight_offset
        # One Triton kernel instead of ~8 torch ops (engine/layers/fused_kernels.py);
        # it implements the Llama form only.
        self.fused = fused and weight_offset == 0.0

    def _norm(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # Statistics in fp32 whatever the activation dtype, then back: the same
        # order of operations as Hugging Face's LlamaRMSNorm / Gemma3RMSNorm, so
        # fp32 runs match it.
        out_dtype = out_dtype or x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            return (x32 * (self.weight_offset + self.weight.float())).to(out_dtype)
        return self.weight * x32.to(out_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or ``(norm(x + residual), x + residual)``.

        The sum is kept in the residual's dtype (fp32 in the decoder: the residual
        stream does not round to bf16 at every layer); the normalised output is in
        ``x``'s dtype.
        """
        if self.fused:
            from engine.layers.fused_kernels import rms_norm

            out, new_residual = rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        total = x.to(residual.dtype) + residual
        return self._norm(total, x.dtype), total
