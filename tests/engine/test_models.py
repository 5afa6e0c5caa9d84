"""Model definitions against HF transformers on the same (tiny, random) weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from tests.conftest import MOE_KINDS, TINY_CONFIGS, write_config_dir

KINDS = list(TINY_CONFIGS)


def make_runner(model_dir, device: str = "cpu", **kwargs) -> ModelRunner:
    config = EngineConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        num_kvcache_blocks=64,
        kvcache_block_size=8,
        device=device,
        **kwargs,
    )
    return ModelRunner(config, frozenset())


@torch.inference_mode()
def our_logits(runner: ModelRunner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits for every position, computing the prompt in the given chunk sizes
    (later chunks attend to earlier ones through the paged KV cache)."""
    table = list(range(-(-len(ids) // runner.block_size)))
    out, start = [], 0
    for n in chunks:
        inputs = runner.build_inputs([ids], [start], [n], [table])
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        out.append(runner.model.compute_logits(hidden))
        start += n
    assert start == len(ids)
    return torch.cat(out)


@torch.inference_mode()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0]


PROMPT = [(i * 37 + 11) % 500 for i in range(45)]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(tiny_model, kind):
    model_dir, hf = tiny_model(kind)
    runner = make_runner(model_dir)
    ours = our_logits(runner, PROMPT, [len(PROMPT)])
    ref = hf_logits(hf, PROMPT)
    assert torch.allclose(ours, ref, atol=2e-5, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_over_paged_prefix_matches(tiny_model, kind, backend):
    """Without a GPU the triton backend runs under Triton's interpreter."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    model_dir, hf = tiny_model(kind)
    runner = make_runner(model_dir, attention_backend=backend)
    # Chunks that end mid-block, then single-token "decode" steps.
    ours = our_logits(runner, PROMPT, [13, 20, 10, 1, 1])
    ref = hf_logits(hf, PROMPT)
    assert torch.allclose(ours, ref, atol=2e-5, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_through_the_fused_triton_kernel_matches(tiny_model, kind):
    """The experts through the fused Triton kernel (Triton's interpreter without a
    GPU) instead of the torch loop: the same logits as HF, chunks and decodes."""
    pytest.importorskip("triton", reason="triton is not installed")
    from engine.layers.moe.layer import FusedMoE

    model_dir, hf = tiny_model(kind)
    runner = make_runner(model_dir)
    moe_layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe_layers
    for layer in moe_layers:
        layer.use_triton = True
    ours = our_logits(runner, PROMPT, [13, 30, 1, 1])
    ref = hf_logits(hf, PROMPT)
    assert torch.allclose(ours, ref, atol=2e-5, rtol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_sharded_checkpoint_loads_the_same(tiny_model, kind):
    model_dir, hf = tiny_model(kind, max_shard_size="100KB")
    assert (model_dir / "model.safetensors.index.json").is_file()
    assert len(list(model_dir.glob("*.safetensors"))) > 1
    ours = our_logits(make_runner(model_dir), PROMPT, [len(PROMPT)])
    assert torch.allclose(ours, hf_logits(hf, PROMPT), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3", "mixtral", "qwen2_moe"])
def test_dummy_weights_from_config_alone(tmp_path, kind):
    model_dir = write_config_dir(tmp_path / "cfg-only", TINY_CONFIGS[kind])
    a = our_logits(make_runner(model_dir, load_format="dummy", seed=1), PROMPT, [len(PROMPT)])
    b = our_logits(make_runner(model_dir, load_format="dummy", seed=1), PROMPT, [len(PROMPT)])
    c = our_logits(make_runner(model_dir, load_format="dummy", seed=2), PROMPT, [len(PROMPT)])
    assert torch.isfinite(a).all()
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        make_runner(model_dir)


def copy_with_tensors(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_and_unexpected_tensors_are_named(tiny_model, tmp_path):
    model_dir, _ = tiny_model("llama")
    missing = copy_with_tensors(
        model_dir, tmp_path / "missing", lambda t: t.pop("model.layers.1.self_attn.v_proj.weight")
    )
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        make_runner(missing)
    extra = copy_with_tensors(
        model_dir, tmp_path / "extra", lambda t: t.update(extra=torch.zeros(2))
    )
    with pytest.raises(ValueError, match="does not use.*extra"):
        make_runner(extra)
    wrong = copy_with_tensors(
        model_dir, tmp_path / "wrong", lambda t: t.update({"model.norm.weight": torch.zeros(3)})
    )
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        make_runner(wrong)


def test_generation_config_eos_ids_are_merged(tiny_model, tmp_path):
    model_dir, _ = tiny_model("qwen2")
    target = tmp_path / "gen"
    shutil.copytree(model_dir, target)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    config = EngineConfig(model=str(target), skip_tokenizer_init=True)
    assert {7, 9} <= set(config.model_config.eos_token_ids)


@torch.inference_mode()
def test_unwritten_cache_slots_are_never_read(tiny_model):
    """Cache memory starts as garbage (torch.empty): fill it with NaN, then decode a
    batch of sequences of different lengths; every logit must stay finite and match HF."""
    model_dir, hf = tiny_model("llama")
    runner = make_runner(model_dir)
    runner.kv_cache.fill_(float("nan"))
    prompts = [PROMPT[:5], PROMPT[:19], PROMPT[:30]]
    tables = [[0], [1, 2, 3], [4, 5, 6, 7]]
    prefill = runner.build_inputs(
        [p[:-1] for p in prompts], [0, 0, 0], [len(p) - 1 for p in prompts], tables
    )
    runner.model(prefill.input_ids, prefill.positions, prefill.meta)
    decode = runner.build_inputs(prompts, [len(p) - 1 for p in prompts], [1, 1, 1], tables)
    assert decode.meta.is_decode_only
    logits = runner.model.compute_logits(
        runner.model(decode.input_ids, decode.positions, decode.meta)
    )
    assert torch.isfinite(logits).all()
    for i, p in enumerate(prompts):
        assert torch.allclose(logits[i], hf_logits(hf, p)[-1], atol=2e-5, rtol=1e-4)


def test_build_inputs_counts_leading_decode_rows(tiny_model):
    """Backends run their decode kernel on the leading one-token rows of a mixed step."""
    model_dir, _ = tiny_model("llama")
    runner = make_runner(model_dir)
    ids = [PROMPT[:20]] * 4
    tables = [[4 * i + j for j in range(4)] for i in range(4)]

    def leading(starts, num_new):
        return runner.build_inputs(ids, starts, num_new, tables).meta.num_decode_seqs

    assert leading([10, 12, 0, 19], [1, 1, 5, 1]) == 2
    assert leading([0, 12, 13, 19], [3, 1, 1, 1]) == 0
    assert leading([10, 12, 13, 19], [1, 1, 1, 1]) == 4
