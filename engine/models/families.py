"""The model families the engine runs, and what config.json says about each.

One decoder (engine/models/decoder.py) runs every family; a family is a set
of facts read here: which layers slide, which MLPs are mixtures of experts and
how their router normalises, Gemma's norms and scales. Torch-free, like the
rest of the configuration: the router reads a model's family without torch.

A config field the engine cannot honour (an attention pattern it lacks; a
quantized checkpoint other than FP8, engine/quantization/scheme.py) raises
one ValueError naming the field and what is supported, rather than loading a
model that would compute something else.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Architecture (config.json's ``architectures``) -> family name (its model_type).
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# Families whose HF config has use_sliding_window (off in every released checkpoint).
_QWEN_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class LayerType(enum.StrEnum):
    """An attention layer's kind (HF's ``layer_types`` values we implement)."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"


@dataclass(slots=True, frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token's ``top_k`` experts out of ``num_experts``."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    # Renormalise the top-k softmax weights to sum to 1 (Mixtral always;
    # Qwen's norm_topk_prob).
    renormalize: bool
    # Qwen2-MoE: one dense expert every token runs, scaled by sigmoid(gate(x)); 0: none.
    shared_expert_intermediate_size: int
    # Per layer: a mixture of experts (True) or a dense MLP of ``intermediate_size``.
    sparse_layers: tuple[bool, ...]


@dataclass(slots=True, frozen=True)
class GemmaFacts:
    """Gemma's departures from the Llama layer (all off for other families)."""

    # RMSNorm weights are stored as w - 1: the norm multiplies by (1 + w).
    norm_weight_offset: float = 0.0
    # Norms after attention and after the MLP too (before each residual add).
    sandwich_norms: bool = False
    # The embedding's rows are multiplied by sqrt(hidden_size).
    embed_scale: float | None = None


def family_of(raw: dict[str, Any]) -> tuple[str, str]:
    """(architecture, family) of a config.json, or a ValueError listing the supported ones."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch, FAMILIES[arch]


def check_supported_fields(raw: dict[str, Any], family: str) -> None:
    """ValueError for a field whose value the engine would silently ignore."""
    act = hidden_act(raw, family)
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"config.json: hidden_act {act!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    if family in _QWEN_FAMILIES and raw.get("use_sliding_window"):
        raise ValueError(
            f"config.json: use_sliding_window=true is not supported for {family}; "
            "sliding windows are supported for mistral, mixtral and gemma3"
        )
    if raw.get("use_bidirectional_attention"):
        raise ValueError(
            "config.json: use_bidirectional_attention=true is not supported; "
            "supported: causal attention"
        )
    if family in MOE_FAMILIES and raw.get("mlp_bias"):
        raise ValueError(f"config.json: mlp_bias=true is not supported for {family}'s experts")


def hidden_act(raw: dict[str, Any], family: str) -> str:
    if family == "gemma3":
        return raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    return raw.get("hidden_act", "silu")


def default_tie_word_embeddings(family: str) -> bool:
    """HF's default where config.json omits tie_word_embeddings."""
    return family == "gemma3"


def bias_flags(raw: dict[str, Any], family: str) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o): Qwen2's q/k/v always carry one and its o never
    does; elsewhere attention_bias puts one on all four."""
    if family == "qwen2":
        return True, False
    if family == "qwen2_moe":
        return bool(raw.get("qkv_bias", True)), False
    on = bool(raw.get("attention_bias", False))
    return on, on


def parse_layer_types(
    raw: dict[str, Any], family: str, num_layers: int
) -> tuple[tuple[LayerType, ...], int | None]:
    """(each layer's kind, the window of the sliding ones in tokens)."""
    window = raw.get("sliding_window")
    if family == "mistral" and "sliding_window" not in raw:
        window = 4096  # HF's MistralConfig default
    if family in _QWEN_FAMILIES:
        window = None  # ignored by HF unless use_sliding_window (refused above)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"config.json: sliding_window must be a positive integer; got {window!r}")
    if family == "gemma3":
        types = raw.get("layer_types")
        if types is None:
            pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)))
            types = [
                LayerType.SLIDING if (i + 1) % pattern else LayerType.FULL
                for i in range(num_layers)
            ]
    elif window is not None:  # Mistral, Mixtral: one window for every layer
        types = [LayerType.SLIDING] * num_layers
    else:
        types = raw.get("layer_types") or [LayerType.FULL] * num_layers
    if len(types) != num_layers:
        raise ValueError(
            f"config.json: layer_types has {len(types)} entries for {num_layers} layers"
        )
    supported = {t.value for t in LayerType}
    unknown = sorted({str(t) for t in types} - supported)
    if unknown:
        raise ValueError(
            f"config.json: layer type(s) {', '.join(unknown)} are not supported; "
            f"supported: {', '.join(sorted(supported))}"
        )
    parsed = tuple(LayerType(t) for t in types)
    if LayerType.SLIDING in parsed and window is None:
        raise ValueError("config.json: sliding_attention layers need a sliding_window")
    return parsed, (window if LayerType.SLIDING in parsed else None)


def parse_moe(raw: dict[str, Any], family: str, num_layers: int) -> MoeConfig | None:
    """The mixture-of-experts facts of an MoE family (None for dense ones)."""
    if family not in MOE_FAMILIES:
        return None
    if family == "mixtral":
        experts = raw.get("num_local_experts", 8)
        inter = raw["intermediate_size"]
        renorm, shared = True, 0
        sparse = (True,) * num_layers
    else:
        # transformers v5 writes Qwen3-MoE's expert count as num_local_experts.
        experts = raw.get("num_experts", raw.get("num_local_experts"))
        if experts is None:
            raise KeyError("num_experts")
        inter = raw["moe_intermediate_size"]
        renorm = bool(raw.get("norm_topk_prob", False))
        shared = (
            int(raw.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
        )
        step = int(raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or ())
        sparse = tuple(
            i not in dense and int(experts) > 0 and (i + 1) % step == 0 for i in range(num_layers)
        )
    top_k = int(raw.get("num_experts_per_tok", 2))
    if not 1 <= top_k <= int(experts):
        raise ValueError(
            f"config.json: num_experts_per_tok ({top_k}) must be between 1 and the number "
            f"of experts ({experts})"
        )
    return MoeConfig(int(experts), top_k, int(inter), renorm, shared, sparse)


def gemma_facts(raw: dict[str, Any], family: str, hidden_size: int) -> GemmaFacts:
    if family != "gemma3":
        return GemmaFacts()
    return GemmaFacts(norm_weight_offset=1.0, sandwich_norms=True, embed_scale=hidden_size**0.5)


def attention_scale(raw: dict[str, Any], family: str, head_dim: int) -> float:
    """The factor on q·k: 1/sqrt(query_pre_attn_scalar) for Gemma, else 1/sqrt(head_dim)."""
    if family == "gemma3":
        return float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5
    return head_dim**-0.5


def soft_caps(raw: dict[str, Any], family: str) -> tuple[float | None, float | None]:
    """(attention logits cap, final logits cap): ``cap * tanh(x / cap)``; None: none.

    Gemma3 soft-caps its final logits where final_logit_softcapping is set.
    Its attn_logit_softcapping (null in the released configs) is not applied by
    Hugging Face's Gemma3 (Gemma2 applied it), and the engine follows the
    reference implementation: the attention backends can cap scores
    (``logits_soft_cap``) for a family that uses it.
    """
    if family != "gemma3":
        return None, None
    if raw.get("attn_logit_softcapping"):
        logger.info("gemma3: attn_logit_softcapping is ignored, as Hugging Face's Gemma3 does")
    final = raw.get("final_logit_softcapping")
    return None, (float(final) if final else None)
