"""FP8 weights (``quantization="fp8"`` and pre-quantized checkpoints) on the CPU.

The demo model quantized at load is held to the fp32 engine on a fixed text,
teacher-forced: the top-1 token agrees at >= 85% of positions and the
perplexity stays within 5% (the figures are printed and in docs/engine.md:
the issue's 97% is not reached by per-channel FP8 on this 135M model, whose
weight rounding alone, activations unquantized, gives 91%).
A tiny random Llama is written by the test in each pre-quantized layout
(per-tensor under both scale names, 128x128 blocks, compressed-tensors per
channel and per tensor), following the published layouts; each loads and
agrees with online quantization (per channel: the same weights exactly). Bad
inputs name the value or the tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.block_hash import hash_prompt_blocks
from engine.quantization.fp8 import FP8_DTYPE, Fp8Linear
from tests.conftest import perplexity, teacher_forced

FP8_MAX = 448.0
_PROJ = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")

# Teacher-forced text for the demo model: plain English prose.
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books far faster than scribes. Within fifty years, presses "
    "had spread to more than two hundred cities across Europe, and millions of volumes were "
    "in circulation. Cheaper books changed how people learned: scholars could compare "
    "editions, merchants kept printed account tables, and ordinary readers found pamphlets "
    "about religion, science and politics. Historians often argue that the Reformation, the "
    "Scientific Revolution and the rise of newspapers all depended on this new technology, "
    "because ideas could now travel quickly and reach a large audience at a low cost."
)


def test_demo_model_fp8_agrees_with_fp32_teacher_forced(demo_model_dir, demo_llm, demo_tokenizer):
    ids = demo_tokenizer.encode(TEXT)
    fp8 = LLM(
        str(demo_model_dir), max_model_len=1024, device="cpu", quantization="fp8",
        num_kvcache_blocks=128,
    )  # fmt: skip
    proj = fp8.llm_engine.model_runner.model.layers[0].mlp.down_proj
    assert isinstance(proj, Fp8Linear) and proj.weight.dtype == FP8_DTYPE
    ref_top, ref_lp = teacher_forced(demo_llm, ids)
    top, lp = teacher_forced(fp8, ids)
    agree = sum(a == b for a, b in zip(top, ref_top, strict=True)) / len(top)
    ppl_ref, ppl = perplexity(ref_lp), perplexity(lp)
    print(f"\nFP8 weights: top-1 agreement {agree:.4f} over {len(top)} positions; "
          f"perplexity fp32 {ppl_ref:.3f}, fp8 {ppl:.3f}")  # fmt: skip
    assert agree >= 0.85
    assert abs(ppl / ppl_ref - 1) < 0.05
    # Block hashes: FP8 blocks carry the quantization key, fp32 ones hash as before.
    bs = fp8.llm_engine.config.kvcache_block_size
    plain = hash_prompt_blocks(ids, demo_llm.llm_engine.config.served_model_name, bs)
    assert fp8.llm_engine.numerics_keys == ("quantization=fp8",)
    assert demo_llm.llm_engine.numerics_keys == ()
    hasher = fp8.llm_engine._hashers.get(None, fp8.llm_engine.numerics_keys)
    assert hasher.hash_blocks(ids)[0] != plain[0]
    assert demo_llm.llm_engine._hashers.get(None, ()).hash_blocks(ids) == plain


# ------------------------------------------------------ pre-quantized checkpoints
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=320,  # 320 = 2.5 blocks of 128: a partial block
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
LM_HEAD_GAIN = 4.0
PROMPT = [(7 * i + 3) % 512 for i in range(48)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # decisive logits: the comparisons below then mean something
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
    out = tmp_path_factory.mktemp("tiny-fp8")
    model.save_pretrained(out)
    return out


def _per_tensor(w):
    s = w.abs().max() / FP8_MAX
    return (w / s).to(FP8_DTYPE), s


def _per_channel(w):
    s = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    return (w / s).to(FP8_DTYPE), s


def _per_block(w, b=128):
    n, k = w.shape
    s = torch.zeros(-(-n // b), -(-k // b))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = w[i * b : (i + 1) * b, j * b : (j + 1) * b].abs().max() / FP8_MAX
    full = s.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
    return (w / full).to(FP8_DTYPE), s


# name -> (quantization_config, quantize(w) -> (fp8, scale), scale tensor name, scale reshape)
FORMATS = {
    "fp8-tensor": (
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        _per_tensor, "weight_scale", (),
    ),
    "fp8-tensor-inv": (
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        _per_tensor, "weight_scale_inv", (1,),
    ),
    "fp8-block": (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]},
        _per_block, "weight_scale_inv", None,
    ),
    "ct-channel": ("channel", _per_channel, "weight_scale", None),
    "ct-tensor": ("tensor", _per_tensor, "weight_scale", (1,)),
}  # fmt: skip


def _ct_config(strategy: str) -> dict:
    static = strategy == "tensor"  # this one also ships static input scales
    acts = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": not static,
            "strategy": "tensor" if static else "token"}  # fmt: skip
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False,
               "strategy": strategy}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": acts}},
    }  # fmt: skip


def write_prequantized(src: Path, dst: Path, fmt: str) -> Path:
    """``src`` (a float checkpoint) written in format ``fmt``, as its tools lay it out."""
    qc, quantize, scale_name, shape = FORMATS[fmt]
    if isinstance(qc, str):
        qc = _ct_config(qc)
    dst.mkdir()
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if name.endswith(".weight") and any(p in name for p in _PROJ):
            q, s = quantize(w.float())
            tensors[name] = q
            prefix = name.removesuffix("weight")
            tensors[prefix + scale_name] = s.reshape(shape) if shape is not None else s
            if qc.get("quant_method") == "compressed-tensors" and fmt == "ct-tensor":
                tensors[prefix + "input_scale"] = torch.ones(1)
        else:
            tensors[name] = w
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.glob("generation_config.json"):
        shutil.copy(f, dst / f.name)
    return dst


def tiny_llm(model_dir: Path, **kw) -> LLM:
    return LLM(
        str(model_dir), device="cpu", skip_tokenizer_init=True, max_model_len=256,
        num_kvcache_blocks=32, **kw,
    )  # fmt: skip


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    _, lp = teacher_forced(llm, PROMPT)
    return torch.tensor(lp)


@pytest.fixture(scope="module")
def online(tiny_dir):
    llm = tiny_llm(tiny_dir, quantization="fp8")
    return llm, prompt_logprobs(llm)


def _dequantized(llm: LLM, name: str) -> torch.Tensor:
    layer = llm.llm_engine.model_runner.model.get_submodule(name)
    return layer.weight.float() * layer.weight_scale.unsqueeze(1)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_prequantized_checkpoint_loads_and_agrees_with_online(tiny_dir, tmp_path, online, fmt):
    online_llm, online_lp = online
    llm = tiny_llm(write_prequantized(tiny_dir, tmp_path / fmt, fmt))
    want = "compressed-tensors" if fmt.startswith("ct") else "fp8"
    assert llm.llm_engine.config.quantization.value == want
    assert llm.llm_engine.numerics_keys == (f"quantization={want}",)
    # Weights: within FP8's rounding of the float checkpoint; per channel, the
    # very weights online quantization makes.
    ref = load_file(tiny_dir / "model.safetensors")
    for layer in ("layers.1.self_attn.qkv_proj", "layers.0.mlp.down_proj"):
        got = _dequantized(llm, layer)
        if layer.endswith("down_proj"):
            w = ref[f"model.{layer}.weight"]
            assert ((got - w).norm() / w.norm()).item() < 0.05
        if fmt == "ct-channel":
            assert torch.equal(got, _dequantized(online_llm, layer))
    lp = prompt_logprobs(llm)
    # Stated tolerance: every prompt logprob within 0.3 nats of online
    # quantization's, 0.1 on average (the two roundings differ by FP8 noise of
    # the size online quantization's own distance from the float model).
    diff = (lp - online_lp).abs()
    assert diff.max().item() < 0.3 and diff.mean().item() < 0.1
    if fmt == "ct-channel":
        assert torch.equal(lp, online_lp)


def test_online_fp8_stays_close_to_the_float_model(tiny_dir, online):
    _, online_lp = online
    ref = prompt_logprobs(tiny_llm(tiny_dir))
    diff = (online_lp - ref).abs()
    assert diff.max().item() < 0.3 and diff.mean().item() < 0.1
    assert not torch.equal(online_lp, ref)  # it did quantize


# ------------------------------------------------------------------ bad input
def test_unknown_quantization_is_refused_listing_the_supported(tiny_dir):
    with pytest.raises(
        ValueError, match=r"quantization must be one of 'fp8', 'compressed-tensors'"
    ):
        tiny_llm(tiny_dir, quantization="int8")


@pytest.mark.parametrize(
    ("fmt", "edit", "match"),
    [
        ("fp8-tensor", "drop", r"layers\.0\.self_attn\.k_proj\.weight is FP8 but its scale "
         r"model\.layers\.0\.self_attn\.k_proj\.weight_scale or .*weight_scale_inv is missing"),
        ("fp8-block", "shape", r"model\.layers\.0\.self_attn\.k_proj\.weight_scale_inv has shape "
         r"\(2, 2\); expected \(1, 1\)"),
        ("ct-channel", "shape", r"model\.layers\.0\.self_attn\.k_proj\.weight_scale has shape "
         r"\(2, 2\); expected \(64, 1\)"),
        ("ct-tensor", "input", r"model\.layers\.0\.self_attn\.k_proj\.input_scale has shape "
         r"\(2, 2\); expected one scale"),
    ],
)  # fmt: skip
def test_missing_or_misshaped_scale_names_the_tensor(tiny_dir, tmp_path, fmt, edit, match):
    path = write_prequantized(tiny_dir, tmp_path / fmt, fmt)
    tensors = load_file(path / "model.safetensors")
    prefix = "model.layers.0.self_attn.k_proj."
    scale = next(n for n in tensors if n.startswith(prefix) and "scale" in n and "input" not in n)
    if edit == "drop":
        del tensors[scale]
    elif edit == "shape":
        tensors[scale] = torch.ones(2, 2)
    else:
        tensors[prefix + "input_scale"] = torch.ones(2, 2)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        tiny_llm(path)


def test_a_quantization_other_than_the_checkpoints_is_refused(tiny_dir, tmp_path):
    path = write_prequantized(tiny_dir, tmp_path / "ct", "ct-channel")
    with pytest.raises(
        ValueError, match=r"quantization='fp8' does not match .*'compressed-tensors'"
    ):
        tiny_llm(path, quantization="fp8")


# ------------------------------------------------------- tensor-parallel shards
def _rank_model(model_dir: Path, rank: int, size: int, quantization=None):
    """Rank ``rank`` of ``size``'s model with its weights loaded (no forward: the
    group only names the rank, so no processes are needed)."""
    from types import SimpleNamespace

    from engine.models.config import ModelArchConfig
    from engine.models.decoder import DecoderForCausalLM
    from engine.models.loader import load_weights

    cfg = ModelArchConfig.from_dir(model_dir)
    group = SimpleNamespace(rank=rank, size=size)
    model = DecoderForCausalLM(cfg, None, 256, tp=group, quantization=quantization)
    load_weights(model, model_dir)
    return model


@pytest.mark.parametrize("fmt", ["online", "ct-channel"])
def test_tp_shards_carry_their_scales(tiny_dir, tmp_path, fmt):
    """Rank 1 of 2: column-parallel q/k/v and gate/up hold the rows (and the
    scales) of their heads and intermediate range; row-parallel down holds its
    columns with every row's scale from the checkpoint (online: its own)."""
    from engine.quantization.scheme import Quantization

    path = tiny_dir if fmt == "online" else write_prequantized(tiny_dir, tmp_path / fmt, fmt)
    quant = Quantization.FP8 if fmt == "online" else Quantization.COMPRESSED_TENSORS
    whole = _rank_model(path, 0, 1, quant).layers[0]
    shard = _rank_model(path, 1, 2, quant).layers[0]
    hd, q = 32, 4 * 32
    # Rank 1: query heads 2-3 and KV head 1 of the fused [q | k | v] rows.
    rows = [*range(2 * hd, q), *range(q + hd, q + 2 * hd), *range(q + 3 * hd, q + 4 * hd)]
    for name in ("weight", "weight_scale"):
        got = getattr(shard.self_attn.qkv_proj, name)
        assert torch.equal(got.float(), getattr(whole.self_attn.qkv_proj, name)[rows].float())
    inter = TINY["intermediate_size"] // 2
    up_rows = [*range(inter, 2 * inter), *range(3 * inter, 4 * inter)]
    assert torch.equal(
        shard.mlp.gate_up_proj.weight_scale, whole.mlp.gate_up_proj.weight_scale[up_rows]
    )
    down, ref = shard.mlp.down_proj, whole.mlp.down_proj
    cols = slice(inter, 2 * inter)
    if fmt == "ct-channel":  # the checkpoint's FP8 values and every row's scale
        assert torch.equal(down.weight_scale, ref.weight_scale)
        assert torch.equal(down.weight.float(), ref.weight[:, cols].float())
    else:  # quantized over its own columns: close to the float weights
        w = load_file(tiny_dir / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
        got = down.weight.float() * down.weight_scale.unsqueeze(1)
        assert ((got - w[:, cols]).norm() / w[:, cols].norm()).item() < 0.05
