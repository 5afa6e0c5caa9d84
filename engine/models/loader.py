"""Weights from safetensors (one file or sharded), or random ones from config.json alone.

With tensor parallelism each rank reads only its shard of each checkpoint
tensor (safetensors' lazy slices: the rest is never read), by the layout of
engine/tp_layout.py. Dummy weights go through the same path: a
checkpoint is synthesised tensor by tensor from the config, each drawn whole
from its own seeded generator and then sliced, so TP = 1, 2, 4 of one seed
hold the same model.
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

from engine.models.config import ModelArchConfig
from engine.models.decoder import DecoderForCausalLM
from engine.tp_layout import TPLayout

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
_KIND_RE = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|o_proj|down_proj)\.(weight|bias)$")

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


def _shard_slice(model: DecoderForCausalLM, fused: str, shard: str) -> slice:
    """Where checkpoint tensor ``shard`` goes in this rank's fused parameter."""
    lay = model.layout
    if fused == "qkv_proj":
        q, kv = lay.num_local_heads * lay.head_dim, lay.num_local_kv_heads * lay.head_dim
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]
    inter = lay.local_intermediate
    return {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}[shard]


def _rank_part(name: str, shape: tuple[int, ...], lay: TPLayout) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor ``name`` (of ``shape``) this rank holds;
    None: none of it (a row-parallel bias off rank 0, which stays zero)."""
    whole = tuple(slice(None) for _ in shape)
    if lay.size == 1:
        return whole
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        r = lay.vocab_range
        return (slice(r.start, r.stop), *whole[1:])
    m = _KIND_RE.search(name)
    if m is None:
        return whole  # norms: replicated
    kind, what = m.groups()
    hd = lay.head_dim
    rows = {
        "q_proj": lay.q_heads,
        "k_proj": lay.kv_heads,
        "v_proj": lay.kv_heads,
        "gate_proj": lay.intermediate_range,
        "up_proj": lay.intermediate_range,
    }
    if kind in rows:  # column-parallel: output rows (and their bias)
        r = rows[kind]
        scale = hd if kind.endswith(("q_proj", "k_proj", "v_proj")) else 1
        return (slice(r.start * scale, r.stop * scale), *whole[1:])
    # Row-parallel (o, down): input columns; the bias is added once, on rank 0.
    if what == "bias":
        return whole if lay.rank == 0 else None
    r = lay.q_heads if kind == "o_proj" else lay.intermediate_range
    scale = hd if kind == "o_proj" else 1
    return (slice(None), slice(r.start * scale, r.stop * scale))


def load_weights(model: DecoderForCausalLM, model_dir: str | Path) -> None:
    """Copy a Hugging Face checkpoint (this rank's shard of it) into ``model``;
    every parameter must be covered."""
    load_tensors(model, iter_checkpoint(model_dir))


def load_tensors(model: DecoderForCausalLM, tensors: Iterator[tuple[str, TensorSource]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {name for name in params if not _is_tied_alias(model, name)}
    loaded: dict[str, set[str | None]] = {}
    unexpected: list[str] = []
    lay = model.layout
    full_shapes = dict(dummy_checkpoint(model.config))
    with torch.no_grad():
        if lay.size > 1:
            # Vocabulary padding rows and row-parallel biases off rank 0 stay zero.
            for param in params.values():
                param.zero_()
        for ckpt_name, (shape, read) in tensors:
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
            want = full_shapes.get(ckpt_name)
            if want is not None and tuple(shape) != want:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name} has shape {tuple(shape)}, expected {want}"
                )
            part = _rank_part(ckpt_name, shape, lay)
            if part is not None:
                target = (
                    param
                    if shard is None
                    else param[_shard_slice(model, name.split(".")[-2], shard)]
                )
                data = read(part)
                if name in ("embed_tokens.weight", "lm_head.weight"):
                    target = target[: data.shape[0]]  # the rest: vocabulary padding
                if target.shape != data.shape:
                    raise ValueError(
                        f"checkpoint tensor {ckpt_name}: this rank's part has shape "
                        f"{tuple(data.shape)}, its parameter {tuple(target.shape)}"
                    )
                target.copy_(data)
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


def dummy_checkpoint(cfg: ModelArchConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The Hugging Face names and shapes of ``cfg``'s checkpoint."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    yield "model.embed_tokens.weight", (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{proj}.weight", (rows, h)
            if cfg.attention_bias:
                yield p + f"self_attn.{proj}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, q)
        if cfg.qk_norm:
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h))):
            yield p + f"mlp.{proj}.weight", shape
            if cfg.mlp_bias:
                yield p + f"mlp.{proj}.bias", (inter,)
        yield p + "mlp.down_proj.weight", (h, inter)
        if cfg.mlp_bias:
            yield p + "mlp.down_proj.bias", (h,)
    yield "model.norm.weight", (h,)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, h)


def init_dummy_weights(model: DecoderForCausalLM, seed: int) -> None:
    """Small uniform random weights (norms at 1): realistic speed, finite activations.

    Each tensor is drawn whole on the parameters' device (an 8B model would take
    minutes on a CPU) from a generator seeded by ``seed`` and its name, then this
    rank's part is kept; the values depend on the seed and the device type only.
    """
    first = next(model.parameters())
    device, dtype = first.device, first.dtype

    def source(name: str, shape: tuple[int, ...]) -> TensorSource:
        def read(part: tuple[slice, ...]) -> torch.Tensor:
            if name.endswith("norm.weight"):
                return torch.ones(shape, device=device, dtype=dtype)[part]
            gen = torch.Generator(device=device)
            gen.manual_seed((seed + zlib.crc32(name.encode())) & 0xFFFF_FFFF_FFFF_FFFF)
            full = torch.empty(shape, device=device, dtype=dtype)
            return full.uniform_(-1e-3, 1e-3, generator=gen)[part]

        return shape, read

    load_tensors(model, ((n, source(n, s)) for n, s in dummy_checkpoint(model.config)))
