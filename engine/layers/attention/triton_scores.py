"""Attention scores shared by the Triton kernels: q·k scaled for a base-2
softmax, soft-capped where the model asks (Gemma: ``cap * tanh(s / cap)`` on
the natural-unit score ``s``, before the change of base)."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.44269504


@triton.jit
def load_kv(ptr, off, mask, like, scale_ptr, KV_FP8: tl.constexpr):
    """A tile of K or V from the cache in ``like``'s dtype: an FP8 cache's
    entries times the layer's scale (read at ``scale_ptr``), converted in
    registers; the cache is never copied out dequantized."""
    x = tl.load(ptr + off, mask=mask, other=0.0)
    if KV_FP8:
        x = (x.to(tl.float32) * tl.load(scale_ptr)).to(like.dtype)
    return x


@triton.jit
def scaled_scores(q, k, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """[rows, keys] scores in base-2 units; ``qk_scale`` = scale * log2(e)."""
    s = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        x = s * (qk_scale / 1.44269504) / softcap
        # tanh(x) = 2 sigmoid(2x) - 1 (no tanh in every Triton backend).
        return (2.0 * tl.sigmoid(2.0 * x) - 1.0) * (softcap * 1.44269504)
    return s * qk_scale
