"""The checkpoint's FP8 KV cache scales: ``model.layers.{i}.self_attn.k_scale``
and ``v_scale`` (the names vLLM reads from FP8 checkpoints), one number each.

A layer without them keeps 1.0, as vLLM does. The weight loader skips these
tensors (engine/models/loader.py); they are read here, whatever the cache
dtype, so that a bf16 node quantizing KV for an FP8 peer uses the same scales
as the peer, which reads them from the same checkpoint.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from engine.models.loader import iter_checkpoint

_SCALE = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\.([kv])_scale")


def read_kv_scales(model_dir: str | Path | None, num_layers: int) -> torch.Tensor:
    """``[num_layers, 2]`` float32: each layer's (k_scale, v_scale); ones where
    the checkpoint has none (or for dummy weights: ``model_dir`` None). A
    scale that is not one positive finite number raises, naming its tensor."""
    scales = torch.ones(num_layers, 2, dtype=torch.float32)
    if model_dir is None:
        return scales
    for name, (shape, read) in iter_checkpoint(model_dir):
        m = _SCALE.fullmatch(name)
        if m is None:
            continue
        layer, which = int(m.group(1)), 0 if m.group(2) == "k" else 1
        if layer >= num_layers:
            raise ValueError(f"checkpoint tensor {name}: the model has {num_layers} layers")
        if math.prod(shape) != 1:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(shape)}; an FP8 KV scale must be "
                "one number per layer (shape () or (1,))"
            )
        value = float(read(tuple(slice(None) for _ in shape)).float().reshape(()))
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"checkpoint tensor {name} is {value}; a KV scale must be > 0")
        scales[layer, which] = value
    return scales
