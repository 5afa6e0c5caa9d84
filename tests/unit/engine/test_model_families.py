"""The families' config.json facts and checkpoint names (torch-free)."""

from __future__ import annotations

import pytest

from engine.models.checkpoint import Split, rank_part, slot_of
from engine.models.config import LayerType, ModelArchConfig
from engine.tp_layout import TPLayout, check_tensor_parallel_size
from tests.conftest import TINY_CONFIGS

S, F = LayerType.SLIDING, LayerType.FULL


def test_each_family_names_itself():
    families = {k: ModelArchConfig.from_dict(raw).model_family for k, raw in TINY_CONFIGS.items()}
    assert families == {
        "llama": "llama",
        "llama3-rope-tied": "llama",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "mistral": "mistral",
        "gemma3": "gemma3",
        "mixtral": "mixtral",
        "qwen2_moe": "qwen2_moe",
        "qwen3_moe": "qwen3_moe",
    }


def test_gemma3_as_the_hub_writes_it():
    """transformers v4's Gemma3 config: rope_local_base_freq, a sliding pattern,
    rope_scaling for the global layers only; tied embeddings by default."""
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "vocab_size": 262144, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }  # fmt: skip
    cfg = ModelArchConfig.from_dict(raw)
    assert cfg.layer_types == (S, S, S, S, S, F, S, S)
    assert cfg.layer_window(0) == 512 and cfg.layer_window(5) is None
    assert cfg.rope.theta == 1e6 and cfg.rope.factor == 8.0
    assert cfg.layer_rope(0).theta == 1e4 and cfg.layer_rope(0).factor == 1.0
    assert cfg.layer_rope(5) is cfg.rope
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.gemma.norm_weight_offset == 1.0 and cfg.gemma.embed_scale == 1152**0.5
    assert cfg.softmax_scale == 256**-0.5 and cfg.final_logit_softcapping is None
    assert cfg.freeing_window is None  # global layers keep every block


def test_sliding_windows_of_the_dense_families():
    mistral = dict(TINY_CONFIGS["mistral"])
    assert ModelArchConfig.from_dict(mistral).freeing_window == 12
    del mistral["sliding_window"]  # HF's MistralConfig default
    assert ModelArchConfig.from_dict(mistral).sliding_window == 4096
    assert ModelArchConfig.from_dict(dict(mistral, sliding_window=None)).freeing_window is None
    # Qwen2.5 ships sliding_window with use_sliding_window false: no window.
    qwen = dict(TINY_CONFIGS["qwen2"], sliding_window=4096, use_sliding_window=False)
    assert ModelArchConfig.from_dict(qwen).sliding_window is None


def test_moe_facts():
    q3 = ModelArchConfig.from_dict(TINY_CONFIGS["qwen3_moe"]).moe
    assert (q3.num_experts, q3.top_k, q3.intermediate_size, q3.renormalize) == (8, 2, 32, True)
    assert q3.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    # transformers v5 writes the expert count as num_local_experts.
    v5 = dict(TINY_CONFIGS["qwen3_moe"], num_local_experts=8)
    del v5["num_experts"]
    assert ModelArchConfig.from_dict(v5).moe == q3
    step2 = ModelArchConfig.from_dict(
        dict(TINY_CONFIGS["qwen3_moe"], decoder_sparse_step=2, mlp_only_layers=[])
    )
    assert step2.moe.sparse_layers == (False, True, False)
    mix = ModelArchConfig.from_dict(TINY_CONFIGS["mixtral"]).moe
    assert (
        mix.renormalize and mix.intermediate_size == 96 and mix.shared_expert_intermediate_size == 0
    )
    q2 = ModelArchConfig.from_dict(TINY_CONFIGS["qwen2_moe"])
    assert q2.moe.shared_expert_intermediate_size == 64 and not q2.moe.renormalize
    assert q2.attention_bias and not q2.o_bias


@pytest.mark.parametrize(
    "family, change, message",
    [
        (
            "llama",
            {"quantization_config": {"quant_method": "awq"}},
            "quant_method 'awq' is not supported; supported: fp8, compressed-tensors",
        ),
        ("llama", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported; supported: silu"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) must be between 1"),
        (
            "gemma3",
            {"layer_types": ["chunked_attention"] * 3},
            "chunked_attention are not supported",
        ),
        ("gemma3", {"layer_types": ["full_attention"]}, "1 entries for 3 layers"),
        ("gemma3", {"use_bidirectional_attention": True}, "bidirectional"),
        ("mistral", {"sliding_window": 0}, "sliding_window must be a positive integer"),
        ("mixtral", {"mlp_bias": True}, "mlp_bias=true is not supported"),
        ("qwen3", {"rope_parameters": {"full_attention": {"rope_theta": 1.0}}}, "gemma3 only"),
        ("qwen3_moe", {"num_experts": None}, "lacks the field 'num_experts'"),
    ],
)
def test_unsupported_fields_raise_one_clear_error(family, change, message):
    raw = {k: v for k, v in dict(TINY_CONFIGS[family], **change).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_dict(raw)


def test_checkpoint_names_of_every_family():
    mixtral = slot_of("layers.3.block_sparse_moe.experts.5.w3.weight")
    assert (mixtral.param, mixtral.part, mixtral.expert) == ("layers.3.mlp.w13_weight", "up", 5)
    assert slot_of("layers.3.block_sparse_moe.experts.5.w2.weight").split is Split.EXPERT_DOWN
    assert slot_of("layers.3.block_sparse_moe.gate.weight").param == "layers.3.mlp.router.weight"
    qwen = slot_of("layers.0.mlp.experts.127.gate_proj.weight")
    assert (qwen.param, qwen.part, qwen.expert) == ("layers.0.mlp.w13_weight", "gate", 127)
    assert slot_of("layers.0.mlp.gate.weight").split is Split.REPLICATED
    shared = slot_of("layers.0.mlp.shared_expert.up_proj.weight")
    assert (shared.param, shared.split) == (
        "layers.0.mlp.shared_expert.gate_up_proj.weight",
        Split.SHARED_UP,
    )
    assert slot_of("layers.0.mlp.shared_expert_gate.weight").split is Split.REPLICATED
    dense = slot_of("layers.1.mlp.up_proj.weight")
    assert (dense.param, dense.split, dense.part) == (
        "layers.1.mlp.gate_up_proj.weight",
        Split.DENSE_UP,
        "up",
    )
    assert slot_of("layers.1.pre_feedforward_layernorm.weight").split is Split.REPLICATED
    assert slot_of("layers.0.block_sparse_moe.experts.0.w9.weight") is None


def test_each_rank_reads_its_slice_of_every_expert():
    cfg = ModelArchConfig.from_dict(TINY_CONFIGS["qwen2_moe"])  # experts of 32, shared of 64
    lay = TPLayout.for_model(cfg, rank=1, size=2)
    up = slot_of("layers.0.mlp.experts.2.up_proj.weight")
    assert rank_part(up, (32, 64), lay) == (slice(16, 32), slice(None))
    down = slot_of("layers.0.mlp.experts.2.down_proj.weight")
    assert rank_part(down, (64, 32), lay) == (slice(None), slice(16, 32))
    shared = slot_of("layers.0.mlp.shared_expert.down_proj.weight")
    assert rank_part(shared, (64, 64), lay) == (slice(None), slice(32, 64))
    assert rank_part(slot_of("layers.0.mlp.gate.weight"), (4, 64), lay) == (slice(None),) * 2
    assert list(lay.local_experts) == [0, 1, 2, 3]  # tensor parallelism keeps every expert
    with pytest.raises(ValueError, match="each expert's intermediate size 30"):
        check_tensor_parallel_size(4, 8, 2, 256, (30,))


@pytest.mark.parametrize("shape, billions", [("qwen3-30b-a3b", 30.53), ("mixtral-8x7b", 46.70)])
def test_the_moe_benchmark_shapes_are_the_public_models(shape, billions):
    import math

    from engine.models.checkpoint import checkpoint_shapes
    from engine.models.shapes import SHAPES

    cfg = ModelArchConfig.from_dict(SHAPES[shape])
    total = sum(math.prod(s) for _, s in checkpoint_shapes(cfg))
    assert total / 1e9 == pytest.approx(billions, abs=0.01)
