"""Attention scores shared by the Triton kernels: q·k scaled for a base-2
softmax, soft-capped where the model asks (Gemma: ``cap * tanh(s / cap)`` on
the natural-unit score ``s``, before the change of base)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.44269504


@triton.jit
def scaled_scores(q, k, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """[rows, keys] scores in base-2 units; ``qk_scale`` = scale * log2(e)."""
    s = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        x = s * (qk_scale / 1.44269504) / softcap
        # tanh(x) = 2 sigmoid(2x) - 1 (no tanh in every Triton backend).
        return (2.0 * tl.sigmoid(2.0 * x) - 1.0) * (softcap * 1.44269504)
    return s * qk_scale
