"""EngineConfig: vLLM names, validation naming the field, clipping, derived defaults."""

from __future__ import annotations

import pytest

from engine.config import (
    AttentionBackendName,
    DeviceKind,
    EngineConfig,
    LoadFormat,
    PreemptionMode,
)
from engine.models.config import ModelArchConfig
from tests.conftest import TINY_CONFIGS, write_config_dir


@pytest.fixture
def model_dir(tmp_path):
    return write_config_dir(tmp_path / "m", TINY_CONFIGS["llama"])


def test_defaults_and_string_modes(model_dir):
    cfg = EngineConfig(model=str(model_dir), attention_backend="torch", device="cpu")
    assert cfg.max_model_len == 512  # the model's max_position_embeddings
    assert cfg.max_num_batched_tokens == 8192
    assert cfg.attention_backend is AttentionBackendName.TORCH
    assert cfg.device is DeviceKind.CPU
    assert cfg.load_format is LoadFormat.AUTO
    assert cfg.preemption_mode is PreemptionMode.RECOMPUTE
    assert cfg.tokenizer == str(model_dir) and cfg.served_model_name == "m"
    assert (
        cfg.dtype == "auto" and EngineConfig(model=str(model_dir), dtype="half").dtype == "float16"
    )


def test_max_model_len_is_clipped(model_dir, caplog):
    cfg = EngineConfig(model=str(model_dir), max_model_len=100_000)
    assert cfg.max_model_len == 512
    assert "clipped" in caplog.text


def test_no_chunking_needs_budget_for_the_longest_prompt(model_dir):
    cfg = EngineConfig(model=str(model_dir), enable_chunked_prefill=False)
    assert cfg.max_num_batched_tokens >= cfg.max_model_len
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model=str(model_dir), enable_chunked_prefill=False, max_num_batched_tokens=100)


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float64"),
        ("seed", -1),
        ("seed", "0"),
        ("max_model_len", 1),
        ("max_model_len", 2.5),
        ("max_num_batched_tokens", 0),
        ("max_num_seqs", 0),
        ("max_logprobs", -1),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("gpu_memory_utilization", "high"),
        ("kvcache_block_size", 12),
        ("kvcache_block_size", 512),
        ("num_kvcache_blocks", 0),
        ("num_kvcache_blocks", -2),
        ("kv_cache_memory_bytes", 0),
        ("enforce_eager", "yes"),
        ("piecewise_cuda_graphs", 1),
        ("enable_prefix_caching", 1),
        ("enable_chunked_prefill", None),
        ("skip_tokenizer_init", "no"),
        ("preemption_mode", "swap"),
        ("tensor_parallel_size", 3),  # does not divide the tiny model's 4 heads
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", 16),
        ("tensor_parallel_size", "2"),
        ("load_format", "gguf"),
        ("device", "tpu"),
        ("attention_backend", "xformers"),
        ("worker_extension_cls", "not a class path"),
        ("worker_extension_cls", "NoModule"),
    ],
)
def test_invalid_fields_raise_value_error_naming_them(model_dir, field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=str(model_dir), **{field: value})


def test_budget_must_cover_max_num_seqs(model_dir):
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(model=str(model_dir), max_num_seqs=64, max_num_batched_tokens=32)


def test_unknown_option_lists_valid_ones(model_dir):
    with pytest.raises(ValueError, match="unknown engine option.*block_size.*valid options"):
        EngineConfig.from_kwargs(str(model_dir), block_size=16)


def test_model_directory_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        EngineConfig(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        EngineConfig(model=str(tmp_path))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    raw = dict(TINY_CONFIGS["llama"], architectures=["GPT2LMHeadModel"])
    supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=f"'GPT2LMHeadModel'.*supported: {supported}"):
        EngineConfig(model=str(write_config_dir(tmp_path / "m", raw)))


def test_unsupported_rope_type(tmp_path):
    raw = dict(TINY_CONFIGS["llama"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="RoPE type 'yarn'"):
        ModelArchConfig.from_dict(raw)


def test_arch_facts():
    qwen2 = ModelArchConfig.from_dict(TINY_CONFIGS["qwen2"])
    qwen3 = ModelArchConfig.from_dict(TINY_CONFIGS["qwen3"])
    llama3 = ModelArchConfig.from_dict(TINY_CONFIGS["llama3-rope-tied"])
    assert qwen2.attention_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    assert (
        llama3.rope.rope_type == "llama3"
        and llama3.rope.factor == 8.0
        and llama3.tie_word_embeddings
    )
    # transformers v5 writes rope_parameters instead of rope_theta/rope_scaling.
    v5 = dict(TINY_CONFIGS["llama"])
    del v5["rope_theta"]
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 1234.0}
    assert ModelArchConfig.from_dict(v5).rope.theta == 1234.0
