"""The architecture facts the engine needs, read from an HF config.json.

What differs between the supported families (sliding windows, experts,
Gemma's norms) is read by engine/models/families.py.

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
from engine.models import families
from engine.models.families import (
    SUPPORTED_ARCHITECTURES,
    GemmaFacts,
    LayerType,
    MoeConfig,
)
from engine.quantization.scheme import CheckpointQuant, parse_checkpoint_quant

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GemmaFacts",
    "LayerType",
    "ModelArchConfig",
    "MoeConfig",
]

SUPPORTED_ROPE_TYPES = tuple(t.value for t in RopeType)


@dataclass(slots=True, frozen=True)
class ModelArchConfig:
    architecture: str
    family: str  # engine/models/families.py: "llama", "qwen3_moe", ...
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
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma3)
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False)
    o_bias: bool = False  # bias on o_proj (attention_bias outside the Qwen2 families)
    hidden_act: str = "silu"  # the gated MLP's activation (SwiGLU, or Gemma's GELU)
    # Each layer's attention kind, and the window (tokens a query sees, itself
    # included) of the sliding ones; None: no layer slides.
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = None
    # RoPE of the sliding layers where it differs from ``rope`` (Gemma3's local base).
    local_rope: RopeConfig | None = None
    moe: MoeConfig | None = None
    attention_scale: float | None = None  # the factor on q·k (None: 1/sqrt(head_dim))
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    gemma: GemmaFacts = field(default_factory=GemmaFacts)
    # A pre-quantized checkpoint's format (config.json's quantization_config).
    checkpoint_quant: CheckpointQuant | None = None

    @property
    def model_family(self) -> str:
        """The family name (``llama``, ``mistral``, ``qwen3_moe``, ...): what
        ``pdctl nodes`` shows."""
        return self.family

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def all_layers_slide(self) -> bool:
        """Every layer attends within a window: KV blocks wholly before every
        running query's window can be freed (none, where some layers are global)."""
        return bool(self.layer_types) and all(t is LayerType.SLIDING for t in self.layer_types)

    @property
    def freeing_window(self) -> int | None:
        """The window behind which a running sequence's KV blocks can be freed:
        the sliding window where every layer slides, else None (global layers,
        Gemma3's among them, read the whole context)."""
        return self.sliding_window if self.all_layers_slide else None

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None for a global layer."""
        if self.layer_types and self.layer_types[layer] is LayerType.SLIDING:
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.local_rope is not None and self.layer_window(layer) is not None:
            return self.local_rope
        return self.rope

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """KV bytes per token, all layers, K and V, at ``element_bytes`` an
        element (2: bf16/fp16)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_bytes

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelArchConfig:
        arch, family = families.family_of(raw)
        families.check_supported_fields(raw, family)
        try:
            cfg = cls(**_fields(raw, arch, family))
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


def _fields(raw: dict[str, Any], arch: str, family: str) -> dict[str, Any]:
    """ModelArchConfig's fields from config.json (KeyError: a required one is missing)."""
    hidden = int(raw["hidden_size"])
    n_heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // n_heads)
    num_layers = int(raw["num_hidden_layers"])
    qkv_bias, o_bias = families.bias_flags(raw, family)
    layer_types, window = families.parse_layer_types(raw, family, num_layers)
    attn_cap, final_cap = families.soft_caps(raw, family)
    rope, local_rope = _parse_ropes(raw, family)
    moe = families.parse_moe(raw, family, num_layers)
    # An MoE model whose every layer is sparse may omit the dense MLP's size.
    dense_inter = raw.get("intermediate_size")
    if dense_inter is None:
        dense_inter = moe.intermediate_size if moe is not None else raw["intermediate_size"]
    tied = raw.get("tie_word_embeddings", families.default_tie_word_embeddings(family))
    return dict(
        architecture=arch,
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(dense_inter),
        num_hidden_layers=num_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=rope,
        tie_word_embeddings=bool(tied),
        attention_bias=qkv_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        raw=raw,
        o_bias=o_bias,
        hidden_act=families.hidden_act(raw, family),
        layer_types=layer_types,
        sliding_window=window,
        local_rope=local_rope,
        moe=moe,
        attention_scale=families.attention_scale(raw, family, head_dim),
        attn_logit_softcapping=attn_cap,
        final_logit_softcapping=final_cap,
        gemma=families.gemma_facts(raw, family, hidden),
        checkpoint_quant=parse_checkpoint_quant(raw.get("quantization_config")),
    )


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


def _parse_ropes(raw: dict[str, Any], family: str) -> tuple[RopeConfig, RopeConfig | None]:
    """(RoPE of the global layers, RoPE of the sliding ones where it differs)."""
    params = raw.get("rope_parameters")
    per_type = isinstance(params, dict) and "rope_type" not in params and "rope_theta" not in params
    if family != "gemma3":
        if per_type:
            raise ValueError(
                "config.json: per-layer-type rope_parameters are supported for gemma3 only"
            )
        return _parse_rope(raw, params or raw.get("rope_scaling")), None
    # Gemma3: global layers use rope_theta (and rope_scaling), sliding ones
    # rope_local_base_freq without scaling; transformers v5 writes both under
    # rope_parameters, keyed by layer type.
    if per_type:
        full = params.get(LayerType.FULL.value) or {}
        local = params.get(LayerType.SLIDING.value) or {}
    else:
        full = dict(raw.get("rope_scaling") or {})
        full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
    return _parse_rope(raw, full), _parse_rope(raw, local)


def _parse_rope(raw: dict[str, Any], params: dict[str, Any] | None) -> RopeConfig:
    scaling = dict(params or {})
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
