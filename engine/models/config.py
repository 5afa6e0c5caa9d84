"""The architecture facts the engine needs, read from an HF config.json.

The raw JSON is parsed here rather than through transformers' config classes so
that the engine reads the same fields whatever transformers version is
installed (v4 writes ``rope_theta``/``rope_scaling``, v5 ``rope_parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.layers.specs import RopeConfig, RopeType

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = tuple(t.value for t in RopeType)


@dataclass(slots=True, frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2: always)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token at 2 bytes per element (bf16/fp16), all layers, K and V."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelArchConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            n_heads = int(raw["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or n_heads),
                head_dim=int(raw.get("head_dim") or hidden // n_heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rope=_parse_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
                bos_token_id=raw.get("bos_token_id"),
                raw=raw,
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the field {e.args[0]!r}") from e
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({cfg.num_key_value_heads})"
            )
        return cfg

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelArchConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model: {str(model_dir)!r} has no config.json; pass a local Hugging Face model "
                "directory (`pdserve model prepare` makes the demo model)"
            )
        raw = json.loads(path.read_text())
        cfg = cls.from_dict(raw)
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            # generation_config's EOS list is the one `generate` stops on (it may
            # list several, e.g. Llama 3's <|eot_id|> and <|end_of_text|>).
            eos = _as_id_tuple(json.loads(gen.read_text()).get("eos_token_id"))
            if eos:
                merged = tuple(dict.fromkeys(cfg.eos_token_ids + eos))
                cfg = _replace(cfg, eos_token_ids=merged)
        return cfg


def _replace(cfg: ModelArchConfig, **changes: Any) -> ModelArchConfig:
    values = {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}
    values.update(changes)
    return ModelArchConfig(**values)


def _as_id_tuple(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, list | tuple):
        return tuple(int(x) for x in v)
    return (int(v),)


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_type" not in params and "rope_theta" not in params:
        # Per-layer-type parameters (not used by the supported architectures).
        raise ValueError("per-layer rope_parameters are not supported")
    scaling = dict(params or raw.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=theta,
        rope_type=RopeType(rope_type),
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            scaling.get(
                "original_max_position_embeddings", raw.get("max_position_embeddings", 8192)
            )
        ),
    )
