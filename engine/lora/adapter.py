"""A PEFT LoRA adapter read from disk and checked against the model.

PEFT saves ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``...) and ``adapter_model.safetensors`` with tensors named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``
(A: ``[r, in]``, B: ``[out, r]``). The layer's output gains
``scaling * x @ A.T @ B.T`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` under rsLoRA); the scaling is folded into B here,
once, so the kernels only multiply.

Everything that would make the adapter compute something other than PEFT
does is refused with the reason: a rank above ``max_lora_rank``, modules the
model lacks (or an MoE layer's MLP), DoRA, trained biases, per-module rank or
alpha patterns, extra modules saved whole, missing files.

The digest (BLAKE2b-128 of both files' bytes) is the adapter's identity in the
block hash: it changes when and only when the numbers do.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.lora.config import TARGET_MODULES
from engine.lora.request import LoRARequest
from engine.models.config import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(
    r"base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be applied to this model as PEFT would."""


class LoRAAdapterNotFound(LoRAAdapterError):
    """The adapter's directory or one of its two files does not exist."""


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter on the host: per (layer, module) its A ``[r, in]`` and its
    scaled B ``[out, r]``, whole (each rank takes its shard when it copies it
    into a device slot)."""

    name: str
    lora_int_id: int
    digest: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shape(cfg: ModelArchConfig, module: str) -> tuple[int, int]:
    """(out, in) of a projection of the whole (unsharded) model."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }[module]


def read_config(request: LoRARequest, max_lora_rank: int) -> tuple[dict, Path]:
    """The adapter's checked adapter_config.json, and its weights file."""
    root = Path(request.lora_path)
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise LoRAAdapterNotFound(
                f"LoRA adapter {request.lora_name!r}: {str(path)!r} does not exist (a PEFT "
                f"adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    config = json.loads(config_path.read_text())
    where = f"LoRA adapter {request.lora_name!r}"
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where} is a {config['peft_type']} adapter, not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"{where}: adapter_config.json has no valid rank r ({rank!r})")
    if rank > max_lora_rank:
        raise LoRAAdapterError(
            f"{where} has rank {rank}, above max_lora_rank {max_lora_rank}; start the engine "
            "with a larger max_lora_rank"
        )
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    bad = sorted(k for k, v in unsupported.items() if v)
    if bad:
        raise LoRAAdapterError(f"{where} uses what this engine does not apply: {', '.join(bad)}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise LoRAAdapterError(
                f"{where} targets modules this model lacks or LoRA does not serve here: "
                f"{unknown}; supported: {list(TARGET_MODULES)}"
            )
    return config, weights_path


def adapter_digest(request: LoRARequest) -> str:
    """BLAKE2b-128 (hex) of the adapter's two files."""
    h = hashlib.blake2b(digest_size=16)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\0")
        h.update((Path(request.lora_path) / name).read_bytes())
    return h.hexdigest()


def load_adapter(
    request: LoRARequest, cfg: ModelArchConfig, max_lora_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Read, check and scale one adapter (host memory, ``dtype``)."""
    config, weights_path = read_config(request, max_lora_rank)
    rank = config["r"]
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            layer, module, which = _parse_name(request, cfg, name)
            parts.setdefault((layer, module), {})[which] = f.get_tensor(name)
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        a, b = _checked_pair(request, cfg, layer, module, ab, rank)
        # The scaling multiplies in fp32, then rounds once to the device dtype.
        weights[layer, module] = (a.to(dtype), (b.float() * scaling).to(dtype))
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} holds no LoRA weights")
    digest = adapter_digest(request)
    return LoRAAdapter(request.lora_name, request.lora_int_id, digest, rank, weights)


def _parse_name(request: LoRARequest, cfg: ModelArchConfig, name: str) -> tuple[int, str, str]:
    where = f"LoRA adapter {request.lora_name!r}"
    match = _TENSOR.fullmatch(name)
    if match is None or match[2] not in TARGET_MODULES:
        raise LoRAAdapterError(
            f"{where}: tensor {name!r} is not a LoRA weight of a module this model serves "
            f"adapters on ({', '.join(TARGET_MODULES)})"
        )
    layer, module = int(match[1]), match[2]
    if layer >= cfg.num_hidden_layers:
        raise LoRAAdapterError(
            f"{where}: tensor {name!r} is for layer {layer}; the model has {cfg.num_hidden_layers}"
        )
    if module in _MLP_MODULES and cfg.moe is not None and cfg.moe.sparse_layers[layer]:
        raise LoRAAdapterError(
            f"{where}: layer {layer}'s MLP is a mixture of experts, which has no {module}"
        )
    return layer, module, match[3]


def _checked_pair(request, cfg, layer, module, ab, rank) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"LoRA adapter {request.lora_name!r}, layer {layer} {module}"
    if set(ab) != {"A", "B"}:
        raise LoRAAdapterError(f"{where}: lora_A and lora_B must both be present")
    out_dim, in_dim = module_shape(cfg, module)
    a, b = ab["A"], ab["B"]
    if tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
        raise LoRAAdapterError(
            f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit rank "
            f"{rank} and the model's ({out_dim}, {in_dim}) projection (another base model?)"
        )
    return a, b
