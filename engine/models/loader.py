"""Weights from safetensors (one file or sharded), or random ones from config.json alone.

Each family's tensor names map to the model's parameters by
engine/models/checkpoint.py (fused q/k/v and gate/up, stacked experts).

With tensor parallelism each rank reads only its shard of each checkpoint
tensor (safetensors' lazy slices: the rest is never read), by the layout of
engine/tp_layout.py. Dummy weights go through the same path: a
checkpoint is synthesised tensor by tensor from the config, each drawn whole
from its own seeded generator and then sliced, so TP = 1, 2, 4 of one seed
hold the same model.

A quantized model's projections hold FP8 weights and per-row scales
(engine/quantization/fp8.py): a float part is quantized as it is copied, a
pre-quantized checkpoint's part arrives with its scales
(engine/quantization/checkpoint.py); a pre-quantized tensor bound for a
parameter kept in the model dtype is dequantized.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.checkpoint import (
    Slot,
    Split,
    checkpoint_shapes,
    expected_parts,
    part_rows,
    rank_part,
    slot_of,
)
from engine.models.config import ModelArchConfig
from engine.models.decoder import DecoderForCausalLM
from engine.quantization.checkpoint import attach_scales, is_scale_tensor
from engine.quantization.fp8 import FP8_DTYPE, QuantizedRows, quantize_rows

logger = logging.getLogger(__name__)

# Checkpoint tensors that are derived here rather than loaded, or read
# elsewhere (FP8 KV scales: engine/models/kv_scales.py).
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$|self_attn\.[kv]_scale$")

# (shape, read): read(slices) returns that part of the tensor, reading nothing else.
TensorSource = tuple[tuple[int, ...], Callable[[tuple[slice, ...]], torch.Tensor]]


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {str(model_dir)!r}; use load_format='dummy' for "
            "random weights"
        )
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"weight shards listed in the index are missing: {missing}")
    return files


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, TensorSource]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                lazy = f.get_slice(name)
                yield name, (tuple(lazy.get_shape()), lazy.__getitem__)


def read_tensors(model_dir: str | Path, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The whole of every checkpoint tensor whose name ``wanted`` accepts."""
    out = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if wanted(name):
                    out[name] = f.get_tensor(name)
    return out


def load_weights(model: DecoderForCausalLM, model_dir: str | Path) -> None:
    """Copy a Hugging Face checkpoint (this rank's shard of it) into ``model``;
    every parameter must be covered."""
    tensors = iter_checkpoint(model_dir)
    quant = model.config.checkpoint_quant
    if quant is not None:  # the scales first: a weight's may sit in another shard
        tensors = attach_scales(tensors, read_tensors(model_dir, is_scale_tensor), quant)
    load_tensors(model, tensors)


def load_tensors(model: DecoderForCausalLM, tensors: Iterator[tuple[str, TensorSource]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    expected = {name for name in params if not _is_tied_alias(model, name)}
    loaded: dict[str, set[tuple[int | None, str | None]]] = {}
    unexpected: list[str] = []
    cfg = model.config
    full_shapes = dict(checkpoint_shapes(cfg))
    with torch.no_grad():
        if model.layout.size > 1:
            # Vocabulary padding rows and row-parallel biases off rank 0 stay zero.
            for param in params.values():
                param.zero_()
        for ckpt_name, (shape, read) in tensors:
            if _IGNORED_RE.search(ckpt_name):
                continue
            name = ckpt_name.removeprefix("model.")
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # some tied checkpoints store the alias too
            slot = slot_of(name)
            param = params.get(slot.param) if slot is not None else None
            if param is None:
                unexpected.append(ckpt_name)
                continue
            want = full_shapes.get(ckpt_name)
            if want is not None and tuple(shape) != want:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name} has shape {tuple(shape)}, expected {want}"
                )
            scale = buffers.get(slot.param.removesuffix("weight") + "weight_scale")
            _copy_part(model, ckpt_name, slot, param, shape, read, scale)
            loaded.setdefault(slot.param, set()).add((slot.expert, slot.part))
    if unexpected:
        raise ValueError(f"checkpoint has tensors this model does not use: {unexpected[:8]}")
    missing = sorted(n for n in expected if not expected_parts(n, cfg) <= loaded.get(n, set()))
    if missing:
        raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}")


def _copy_part(model, ckpt_name: str, slot: Slot, param, shape, read, scale=None) -> None:
    """Copy this rank's part of one checkpoint tensor into its place in ``param``
    (and its per-row scales into ``scale`` where ``param`` is FP8)."""
    part = rank_part(slot, shape, model.layout)
    if part is None:
        return
    target = param if slot.expert is None else param[slot.expert]
    rows = slice(None)
    if slot.part is not None:
        rows = part_rows(slot, target.shape[0], model.layout)
        target = target[rows]
    data = read(part)
    row_scales = None
    if param.dtype == FP8_DTYPE:
        data = data if isinstance(data, QuantizedRows) else quantize_rows(data)
        data, row_scales = data.data, data.scale
    elif isinstance(data, QuantizedRows):
        data = data.dequantize(target.dtype)
    if slot.split is Split.VOCAB:
        target = target[: data.shape[0]]  # the rest: vocabulary padding
    if target.shape != data.shape:
        raise ValueError(
            f"checkpoint tensor {ckpt_name}: this rank's part has shape "
            f"{tuple(data.shape)}, its parameter {tuple(target.shape)}"
        )
    target.copy_(data)
    if row_scales is not None:
        scale[rows].copy_(row_scales)


def _is_tied_alias(model: DecoderForCausalLM, name: str) -> bool:
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def dummy_checkpoint(cfg: ModelArchConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Hugging Face names and shapes of ``cfg``'s checkpoint."""
    return checkpoint_shapes(cfg)


def init_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Small uniform random weights (norms at 1): realistic speed, finite activations.

    Each tensor is drawn whole on the parameters' device (an 8B model would take
    minutes on a CPU) from a generator seeded by ``seed`` and its name, then this
    rank's part is kept; the values depend on the seed and the device type only.
    """
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    norm_value = 1.0 - model.config.gemma.norm_weight_offset

    def source(name: str, shape: tuple[int, ...]) -> TensorSource:
        def read(part: tuple[slice, ...]) -> torch.Tensor:
            if name.endswith("norm.weight"):  # a scale of 1 (Gemma stores it less 1)
                return torch.full(shape, norm_value, device=device, dtype=dtype)[part]
            gen = torch.Generator(device=device)
            gen.manual_seed((seed + zlib.crc32(name.encode())) & 0xFFFF_FFFF_FFFF_FFFF)
            full = torch.empty(shape, device=device, dtype=dtype)
            return full.uniform_(-1e-3, 1e-3, generator=gen)[part]

        return shape, read

    load_tensors(model, ((n, source(n, s)) for n, s in dummy_checkpoint(model.config)))
