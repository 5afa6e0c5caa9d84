"""The experts in plain torch: the CPU path and the oracle of the fused kernel.

Hugging Face's loop, in its order of operations (so fp32 runs match it): for
each expert that some token chose, its tokens' gate/up projection, the
activation, the down projection, scaled by the routing weight and added into
the token's output. The loop reads which experts were chosen on the host (a
device sync per layer): fine on a CPU, not for CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def reference_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k]: local expert ids, -1 for experts held elsewhere
    act: nn.Module,
) -> torch.Tensor:
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    ids = topk_ids.long()
    hit = torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist()
    for e in hit:
        token, slot = torch.where(ids == e)
        h = act(F.linear(x[token], w13[e]))
        h = F.linear(h, w2[e]) * topk_weights[token, slot, None]
        out.index_add_(0, token, h.to(out.dtype))
    return out
