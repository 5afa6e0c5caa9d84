"""Which weight quantization the engine runs, and what a checkpoint's
``quantization_config`` says (torch-free: the router reads model configs too).

Every method runs the same numerics (docs/engine.md, "FP8 weights"): FP8
e4m3 weights with one scale per output channel, activations quantized per
token at run time. What differs is where the weights come from:

- ``quantization="fp8"`` on a bf16/fp16/fp32 checkpoint: quantized at load;
- a checkpoint whose config.json has ``quant_method: "fp8"`` (transformers'
  and vLLM's layout): FP8 ``weight`` plus a per-tensor scale
  (``weight_scale``, or ``weight_scale_inv`` as transformers names it) or
  ``weight_block_size`` tiles (``weight_scale_inv``, one scale per tile);
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"``:
  FP8 ``weight`` plus ``weight_scale`` per tensor or per channel.

Both scale names multiply: weight = fp8 value * scale.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Quantization(enum.Enum):
    """vLLM's ``quantization`` names the engine accepts."""

    FP8 = "fp8"
    COMPRESSED_TENSORS = "compressed-tensors"


SUPPORTED_QUANTIZATION = tuple(q.value for q in Quantization)


class ScaleLayout(enum.Enum):
    """How a pre-quantized checkpoint's weight scales cover the weight."""

    TENSOR = "tensor"  # one scale for the whole tensor
    CHANNEL = "channel"  # one per output row, shaped (N, 1)
    BLOCK = "block"  # one per (rows, cols) tile, shaped (ceil(N/rows), ceil(K/cols))


@dataclass(slots=True, frozen=True)
class CheckpointQuant:
    """A pre-quantized checkpoint's format."""

    method: Quantization
    layout: ScaleLayout
    scale_names: tuple[str, ...]  # the suffixes its scale tensors may carry
    block: tuple[int, int] | None = None  # ScaleLayout.BLOCK's tile


def parse_quantization(value: Any) -> Quantization | None:
    """The ``quantization`` option (None: none asked for); ValueError listing the
    supported values."""
    if value is None or isinstance(value, Quantization):
        return value
    for q in Quantization:
        if value == q.value:
            return q
    raise ValueError(
        f"quantization must be one of {', '.join(repr(v) for v in SUPPORTED_QUANTIZATION)} "
        f"(or None); got {value!r}"
    )


def parse_checkpoint_quant(qc: dict[str, Any] | None) -> CheckpointQuant | None:
    """config.json's ``quantization_config`` (None: an unquantized checkpoint);
    ValueError naming the field for a format the engine does not read."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == Quantization.FP8.value:
        return _fp8_method(qc)
    if method == Quantization.COMPRESSED_TENSORS.value:
        return _compressed_tensors(qc)
    raise ValueError(
        f"config.json: quantization_config.quant_method {method!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_QUANTIZATION)} (FP8), or an unquantized checkpoint"
    )


def resolve_quantization(
    requested: Quantization | None, checkpoint: CheckpointQuant | None
) -> Quantization | None:
    """The method the engine runs: the checkpoint's when it is pre-quantized (as
    vLLM, a mismatching ``quantization`` is an error), else the requested one."""
    if checkpoint is None:
        if requested is Quantization.COMPRESSED_TENSORS:
            raise ValueError(
                "quantization='compressed-tensors' needs a compressed-tensors checkpoint; "
                "use quantization='fp8' to quantize an unquantized checkpoint at load"
            )
        return requested
    if requested is not None and requested is not checkpoint.method:
        raise ValueError(
            f"quantization={requested.value!r} does not match the checkpoint's "
            f"quantization_config ({checkpoint.method.value!r}); pass "
            f"{checkpoint.method.value!r} or leave quantization unset"
        )
    return checkpoint.method


def _fp8_method(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"config.json: quantization_config.fmt {fmt!r} is not supported; use e4m3")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"config.json: quantization_config.activation_scheme {scheme!r} is not supported; "
            "supported: 'dynamic', 'static'"
        )
    block = qc.get("weight_block_size")
    if block is None:
        names = ("weight_scale", "weight_scale_inv")
        return CheckpointQuant(Quantization.FP8, ScaleLayout.TENSOR, names)
    return CheckpointQuant(
        Quantization.FP8,
        ScaleLayout.BLOCK,
        ("weight_scale_inv",),
        _block(block, "weight_block_size"),
    )


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("config.json: compressed-tensors quantization_config has no config_groups")
    formats = {g.get("format") or qc.get("format") for g in groups}
    if formats != {"float-quantized"}:
        raise ValueError(
            f"config.json: compressed-tensors format {sorted(map(str, formats))} is not "
            "supported; supported: 'float-quantized' (FP8)"
        )
    layouts = {_ct_group_layout(g) for g in groups}
    if len(layouts) != 1:
        raise ValueError("config.json: compressed-tensors groups with different weight strategies")
    layout, block = layouts.pop()
    return CheckpointQuant(Quantization.COMPRESSED_TENSORS, layout, ("weight_scale",), block)


def _ct_group_layout(group: dict[str, Any]) -> tuple[ScaleLayout, tuple[int, int] | None]:
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(
            "config.json: compressed-tensors weights must be type 'float' with num_bits 8 (FP8); "
            f"got type {weights.get('type')!r}, num_bits {weights.get('num_bits')!r}"
        )
    acts = group.get("input_activations")
    if not acts or acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise ValueError(
            "config.json: compressed-tensors weight-only FP8 (no FP8 input_activations) is not "
            "supported; supported: W8A8 (FP8 weights and FP8 input_activations)"
        )
    strategy = weights.get("strategy")
    if strategy == "tensor":
        return ScaleLayout.TENSOR, None
    if strategy == "channel":
        return ScaleLayout.CHANNEL, None
    if strategy == "block":
        return ScaleLayout.BLOCK, _block(weights.get("block_structure"), "block_structure")
    raise ValueError(
        f"config.json: compressed-tensors weight strategy {strategy!r} is not supported; "
        "supported: 'tensor', 'channel', 'block'"
    )


def _block(value: Any, name: str) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ValueError(f"config.json: {name} must be two positive integers; got {value!r}")
    return int(value[0]), int(value[1])
