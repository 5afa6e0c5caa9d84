"""Top-k expert selection: softmax over the router's logits, the k largest,
renormalised to sum to one where the family does (Mixtral always; Qwen's
``norm_topk_prob``). In fp32 whatever the activation dtype, as Hugging Face
computes it.
"""

from __future__ import annotations

import torch


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]) for logits [T, num_experts]."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
