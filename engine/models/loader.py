"""Weights from safetensors (one file or sharded), or random ones from config.json alone."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)

# Checkpoint tensors that become a slice of one fused parameter here.
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_PACKED_RE = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.")
# Checkpoint tensors that are derived here rather than loaded.
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


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


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def _shard_slice(model: DecoderForCausalLM, fused: str, shard: str) -> slice:
    cfg = model.config
    if fused == "qkv_proj":
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]
    inter = cfg.intermediate_size
    return {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}[shard]


def load_weights(model: DecoderForCausalLM, model_dir: str | Path) -> None:
    """Copy a Hugging Face checkpoint into ``model``; every parameter must be covered."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {name for name in params if not _is_tied_alias(model, name)}
    loaded: dict[str, set[str | None]] = {}
    unexpected: list[str] = []
    with torch.no_grad():
        for ckpt_name, tensor in iter_checkpoint(model_dir):
            if _IGNORED_RE.search(ckpt_name):
                continue
            name = ckpt_name.removeprefix("model.")
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # some tied checkpoints store the alias too
            shard = None
            m = _PACKED_RE.search(name)
            if m:
                fused, shard = _PACKED[m.group(1)]
                name = name.replace(m.group(1), fused)
            param = params.get(name)
            if param is None:
                unexpected.append(ckpt_name)
                continue
            target = (
                param if shard is None else param[_shard_slice(model, name.split(".")[-2], shard)]
            )
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.setdefault(name, set()).add(shard)
    if unexpected:
        raise ValueError(f"checkpoint has tensors this model does not use: {unexpected[:8]}")
    missing = sorted(n for n in expected if n not in loaded or not _complete(n, loaded[n]))
    if missing:
        raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}")


def _complete(name: str, shards: set[str | None]) -> bool:
    if ".qkv_proj." in name:
        return shards == {"q", "k", "v"}
    if ".gate_up_proj." in name:
        return shards == {"gate", "up"}
    return shards == {None}


def _is_tied_alias(model: DecoderForCausalLM, name: str) -> bool:
    return name == "lm_head.weight" and model.config.tie_word_embeddings


def init_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Small uniform random weights (norms at 1): realistic speed, finite activations.

    Drawn on the parameters' device (an 8B model would take minutes on a CPU), so
    the values depend on the seed and the device type.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device)
                gen.manual_seed(seed)
            param.uniform_(-1e-3, 1e-3, generator=gen)
