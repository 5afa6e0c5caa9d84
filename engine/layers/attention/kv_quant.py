"""FP8 KV cache arithmetic in torch: the write path's quantization, the torch
backend's dequantization on read, and the scales vLLM computes on the fly.

One scale per layer for K and one for V (vLLM's per-tensor scheme): a cache
entry ``q`` stands for ``q * scale``. A layer's scales are a float32 tensor
``[k_scale, v_scale]`` on the model's device, read by the kernels through a
pointer, so a CUDA graph sees scales computed after it was captured.
"""

from __future__ import annotations

import torch

from engine.kv_cache_dtype import FP8_E4M3_NAME

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max
# vLLM's defaults for calculate_kv_scales (its K_SCALE_CONSTANT and
# V_SCALE_CONSTANT): scale = max |x| / constant, leaving headroom below
# FP8_MAX for later prompts whose K or V run larger than the first's.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bytes where it holds FP8: copies by index (``index_copy_``) have
    no FP8 kernel on a CPU, and moving bytes moves the cache dtype unchanged."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in FP8, saturated at its largest finite value (e4m3fn has no
    infinity: a value past it would become NaN)."""
    y = x.to(torch.float32) / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


def compute_scales(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """vLLM's on-the-fly scales of one layer from one step's K and V:
    ``[max|k| / K_SCALE_CONSTANT, max|v| / V_SCALE_CONSTANT]`` (a zero maximum
    keeps 1.0, which any scale would fit)."""
    amax = torch.stack([k.abs().amax(), v.abs().amax()]).to(torch.float32)
    scales = amax / torch.tensor([K_SCALE_CONSTANT, V_SCALE_CONSTANT], device=amax.device)
    return torch.where(amax > 0, scales, torch.ones_like(scales))


def scales_or(kv_scales: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    """The scales argument of a kernel over ``cache``: ``kv_scales``, required
    for an FP8 cache; for another, any pointer (the kernel never reads it)."""
    if kv_scales is not None:
        return kv_scales
    if is_fp8(cache.dtype):
        raise ValueError("an FP8 KV cache needs its layer's kv_scales")
    return cache


def quantized_name(dtype: torch.dtype) -> str:
    """What a cache of ``dtype`` is called where it is not the model's dtype:
    "fp8_e4m3" for FP8, "" otherwise (engine/kv_cache_dtype.py)."""
    return FP8_E4M3_NAME if is_fp8(dtype) else ""


def quantize_chunk(data: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """A gathered chunk ``[2, layers, ...]`` into ``out`` (FP8, the same shape),
    K and V of each layer by ``scales`` ``[layers, 2]`` (the layers' [k_scale,
    v_scale]). ``data`` (the caller's own buffer) is overwritten: scaled in
    place, no temporary of the chunk's size is made (on a GPU this runs on the
    gather stream, whose own pool the engine's memory budget does not count)."""
    shape = (2, scales.shape[0]) + (1,) * (data.dim() - 2)
    data.div_(scales.t().reshape(shape)).clamp_(-FP8_MAX, FP8_MAX)
    out.copy_(data)
