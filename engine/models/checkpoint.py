"""Where each Hugging Face checkpoint tensor goes in the model, and what a
family's checkpoint holds (names and shapes, for dummy weights and checks).

Torch-free. The families name their tensors their own way; ``slot_of`` maps
every name to one ``Slot``: the parameter, the part of a fused or stacked
parameter it fills (q/k/v of ``qkv_proj``, gate/up of ``gate_up_proj``, an
expert of ``w13_weight``/``w2_weight``) and how tensor parallelism splits it
(``Split``). ``rank_part`` turns the split into the slices one rank reads.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass

from engine.models.config import ModelArchConfig
from engine.tp_layout import TPLayout


class Split(enum.Enum):
    """How a checkpoint tensor is divided among tensor-parallel ranks."""

    REPLICATED = "replicated"  # norms, the router, the shared expert's gate
    VOCAB = "vocab"  # embedding and LM head rows
    Q = "q"  # column-parallel rows of these heads
    KV = "kv"
    DENSE_UP = "dense_up"  # column-parallel rows of the intermediate range
    EXPERT_UP = "expert_up"
    SHARED_UP = "shared_up"
    OUT = "o"  # row-parallel columns (a bias: rank 0 only)
    DENSE_DOWN = "dense_down"
    EXPERT_DOWN = "expert_down"
    SHARED_DOWN = "shared_down"


@dataclass(slots=True, frozen=True)
class Slot:
    param: str  # our parameter's name
    split: Split
    part: str | None = None  # "q"/"k"/"v" of qkv_proj, "gate"/"up" of a gate/up pair
    expert: int | None = None  # the index in a stacked experts parameter


_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_ATTN = {"q_proj": ("q", Split.Q), "k_proj": ("k", Split.KV), "v_proj": ("v", Split.KV)}
# Each family's expert projection names -> gate / up / down.
_EXPERT_PROJ = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_MLP_PROJ = re.compile(r"(mlp|mlp\.shared_expert)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def slot_of(name: str) -> Slot | None:
    """The slot of checkpoint tensor ``name`` (without its ``model.`` prefix); None:
    a tensor this model has no place for."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Slot(name, Split.VOCAB)
    m = _LAYER.match(name)
    if m is None:
        return Slot(name, Split.REPLICATED) if name == "norm.weight" else None
    prefix, rest = f"layers.{m.group(1)}.", m.group(2)
    attn = re.fullmatch(r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)", rest)
    if attn:
        proj, what = attn.groups()
        if proj == "o_proj":
            return Slot(prefix + rest, Split.OUT)
        part, split = _ATTN[proj]
        return Slot(f"{prefix}self_attn.qkv_proj.{what}", split, part)
    expert = _EXPERT.fullmatch(rest)
    if expert:
        e, proj = int(expert.group(1)), _EXPERT_PROJ.get(expert.group(2))
        if proj is None:
            return None
        if proj == "down":
            return Slot(f"{prefix}mlp.w2_weight", Split.EXPERT_DOWN, None, e)
        return Slot(f"{prefix}mlp.w13_weight", Split.EXPERT_UP, proj, e)
    if rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):
        return Slot(f"{prefix}mlp.router.weight", Split.REPLICATED)
    mlp = _MLP_PROJ.fullmatch(rest)
    if mlp:
        module, proj, what = mlp.groups()
        shared = module.endswith("shared_expert")
        if proj == "down_proj":
            return Slot(prefix + rest, Split.SHARED_DOWN if shared else Split.DENSE_DOWN)
        up = Split.SHARED_UP if shared else Split.DENSE_UP
        return Slot(f"{prefix}{module}.gate_up_proj.{what}", up, proj.removesuffix("_proj"))
    return Slot(prefix + rest, Split.REPLICATED)


def rank_part(slot: Slot, shape: tuple[int, ...], lay: TPLayout) -> tuple[slice, ...] | None:
    """The slices of a checkpoint tensor of ``shape`` that this rank holds; None:
    none of it (a row-parallel bias off rank 0, which stays zero)."""
    whole = tuple(slice(None) for _ in shape)
    if lay.size == 1 or slot.split is Split.REPLICATED:
        return whole
    hd = lay.head_dim
    rows = {
        Split.VOCAB: (lay.vocab_range, 1),
        Split.Q: (lay.q_heads, hd),
        Split.KV: (lay.kv_heads, hd),
        Split.DENSE_UP: (lay.intermediate_range, 1),
        Split.EXPERT_UP: (lay.expert_intermediate_range, 1),
        Split.SHARED_UP: (lay.shared_intermediate_range, 1),
    }
    if slot.split in rows:  # column-parallel: output rows (and their bias)
        r, scale = rows[slot.split]
        return (slice(r.start * scale, r.stop * scale), *whole[1:])
    if len(shape) == 1:  # a row-parallel bias: added once, on rank 0
        return whole if lay.rank == 0 else None
    cols = {
        Split.OUT: (lay.q_heads, hd),
        Split.DENSE_DOWN: (lay.intermediate_range, 1),
        Split.EXPERT_DOWN: (lay.expert_intermediate_range, 1),
        Split.SHARED_DOWN: (lay.shared_intermediate_range, 1),
    }
    r, scale = cols[slot.split]
    return (slice(None), slice(r.start * scale, r.stop * scale))


def part_rows(slot: Slot, param_rows: int, lay: TPLayout) -> slice:
    """The rows of this rank's fused parameter that ``slot``'s part fills."""
    if slot.part in ("q", "k", "v"):
        q, kv = lay.num_local_heads * lay.head_dim, lay.num_local_kv_heads * lay.head_dim
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[slot.part]
    half = param_rows // 2  # gate rows, then up rows
    return slice(0, half) if slot.part == "gate" else slice(half, param_rows)


def expected_parts(param: str, cfg: ModelArchConfig) -> set[tuple[int | None, str | None]]:
    """The (expert, part) pairs that together fill parameter ``param``."""
    if param.endswith(".qkv_proj.weight") or param.endswith(".qkv_proj.bias"):
        return {(None, "q"), (None, "k"), (None, "v")}
    if ".gate_up_proj." in param:
        return {(None, "gate"), (None, "up")}
    experts = range(cfg.moe.num_experts) if cfg.moe is not None else range(0)
    if param.endswith(".w13_weight"):
        return {(e, p) for e in experts for p in ("gate", "up")}
    if param.endswith(".w2_weight"):
        return {(e, None) for e in experts}
    return {(None, None)}


def checkpoint_shapes(cfg: ModelArchConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Hugging Face names and shapes of ``cfg``'s checkpoint."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    yield "model.embed_tokens.weight", (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.gemma.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            yield p + f"{norm}.weight", (h,)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{proj}.weight", (rows, h)
            if cfg.attention_bias:
                yield p + f"self_attn.{proj}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, q)
        if cfg.o_bias:
            yield p + "self_attn.o_proj.bias", (h,)
        if cfg.qk_norm:
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            yield from _moe_shapes(cfg, p)
        else:
            yield from _mlp_shapes(p + "mlp.", h, cfg.intermediate_size, cfg.mlp_bias)
    yield "model.norm.weight", (h,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, h)


def _mlp_shapes(p: str, h: int, inter: int, bias: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    for proj in ("gate_proj", "up_proj"):
        yield p + f"{proj}.weight", (inter, h)
        if bias:
            yield p + f"{proj}.bias", (inter,)
    yield p + "down_proj.weight", (h, inter)
    if bias:
        yield p + "down_proj.bias", (h,)


def _moe_shapes(cfg: ModelArchConfig, p: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    moe, h = cfg.moe, cfg.hidden_size
    inter = moe.intermediate_size
    if cfg.family == "mixtral":
        yield p + "block_sparse_moe.gate.weight", (moe.num_experts, h)
        for e in range(moe.num_experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            yield q + "w1.weight", (inter, h)
            yield q + "w2.weight", (h, inter)
            yield q + "w3.weight", (inter, h)
        return
    yield p + "mlp.gate.weight", (moe.num_experts, h)
    for e in range(moe.num_experts):
        yield from _mlp_shapes(f"{p}mlp.experts.{e}.", h, inter, False)
    if moe.shared_expert_intermediate_size:
        yield from _mlp_shapes(
            p + "mlp.shared_expert.", h, moe.shared_expert_intermediate_size, False
        )
        yield p + "mlp.shared_expert_gate.weight", (1, h)
