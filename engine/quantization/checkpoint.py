"""Reading a pre-quantized FP8 checkpoint (engine/quantization/scheme.py says
which format): each FP8 ``weight`` joined with its scales as ``QuantizedRows``.

The loader (engine/models/loader.py) reads scale tensors first (they are
small), then streams the weights through ``attach_scales``: a weight read in
FP8 comes back as this rank's rows with one scale per row, which is how
``Fp8Linear`` holds it. Per-tensor and per-channel scales carry over exactly
(a fused q/k/v keeps each part's own scale); block scales (one per
``weight_block_size`` tile) vary along the input dimension too, so each
rank's part is dequantized and quantized again per row (one more FP8
rounding; no block-scaled GEMM yet). A weight the checkpoint left in floating
point (its ignore list) comes back as it is, and the loader quantizes it as
``quantization="fp8"`` would. ``input_scale`` (static activation scales) is
read and checked but not applied: activations are always scaled per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from engine.quantization.fp8 import FP8_DTYPE, QuantizedRows, quantize_rows
from engine.quantization.scheme import CheckpointQuant, ScaleLayout

INPUT_SCALE = "input_scale"
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", INPUT_SCALE)

Source = tuple[tuple[int, ...], Callable[[tuple[slice, ...]], torch.Tensor]]


def is_scale_tensor(name: str) -> bool:
    """A scale tensor of either layout (read up front, not streamed)."""
    return name.rsplit(".", 1)[-1] in _SCALE_SUFFIXES


def attach_scales(
    tensors: Iterator[tuple[str, Source]], scales: dict[str, torch.Tensor], quant: CheckpointQuant
) -> Iterator[tuple[str, Source]]:
    """The checkpoint's tensors without its scale tensors, each weight's reader
    returning ``QuantizedRows`` where the weight is stored in FP8."""
    for name, (shape, read) in tensors:
        if is_scale_tensor(name):
            if name.endswith(INPUT_SCALE):
                _check_single(name, scales[name])
            continue
        if name.endswith(".weight") and len(shape) == 2:
            yield name, (shape, _scaled_reader(name, tuple(shape), read, scales, quant))
        else:
            yield name, (shape, read)


def _scaled_reader(name, shape, read, scales, quant: CheckpointQuant):
    def reader(part: tuple[slice, ...]) -> torch.Tensor | QuantizedRows:
        data = read(part)
        if data.dtype != FP8_DTYPE:
            return data  # left unquantized by the checkpoint
        return _rows(data, part, _scale_of(name, shape, scales, quant), quant, shape)

    return reader


def _scale_of(
    name: str, shape: tuple[int, int], scales: dict[str, torch.Tensor], quant: CheckpointQuant
) -> torch.Tensor:
    """The weight's scale tensor, checked against its layout; ValueError naming
    the tensor when it is missing or mis-shaped."""
    prefix = name.removesuffix("weight")
    found = [prefix + s for s in quant.scale_names if prefix + s in scales]
    if not found:
        wanted = " or ".join(prefix + s for s in quant.scale_names)
        raise ValueError(f"checkpoint tensor {name} is FP8 but its scale {wanted} is missing")
    scale_name = found[0]
    scale = scales[scale_name].float()
    n, k = shape
    if quant.layout is ScaleLayout.TENSOR:
        _check_single(scale_name, scale)
        return scale.reshape(1)
    if quant.layout is ScaleLayout.CHANNEL:
        if tuple(scale.shape) not in ((n, 1), (n,)):
            raise ValueError(
                f"checkpoint tensor {scale_name} has shape {tuple(scale.shape)}; expected "
                f"({n}, 1): one scale per output channel of {name} {shape}"
            )
        return scale.reshape(n)
    bn, bk = quant.block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"checkpoint tensor {scale_name} has shape {tuple(scale.shape)}; expected {want}: "
            f"one scale per {bn}x{bk} block of {name} {shape}"
        )
    return scale


def _rows(
    data: torch.Tensor,
    part: tuple[slice, ...],
    scale: torch.Tensor,
    quant: CheckpointQuant,
    shape: tuple[int, int],
) -> QuantizedRows:
    """This rank's part of an FP8 weight with one scale per row."""
    rows = data.shape[0]
    if quant.layout is ScaleLayout.TENSOR:
        return QuantizedRows(data, scale.expand(rows).contiguous())
    if quant.layout is ScaleLayout.CHANNEL:
        return QuantizedRows(data, scale[part[0]].contiguous())
    bn, bk = quant.block
    n, k = shape
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return quantize_rows(data.float() * full[part[0], part[1]])


def _check_single(name: str, scale: torch.Tensor) -> None:
    if scale.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(scale.shape)}; expected one scale "
            "(per-tensor)"
        )
