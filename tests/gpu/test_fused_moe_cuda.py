"""The fused MoE kernel on a GPU: the real models' expert shapes against the torch
loop (bf16), CUDA-graph replay, the tuner, and MoE / sliding-window engines with
CUDA graphs against eager ones.

    python -m pytest tests/gpu/test_fused_moe_cuda.py -q    # on a GPU host
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.activation import SiluAndMul
from engine.layers.moe.configs import default_config
from engine.layers.moe.reference import reference_experts
from engine.layers.moe.routing import select_experts

pytestmark = pytest.mark.gpu

# (experts, one expert's intermediate size, hidden size, top-k): Qwen3-30B-A3B
# at TP 1 and 4, Mixtral-8x7B at TP 2.
SHAPES = [(128, 768, 2048, 8), (128, 192, 2048, 8), (8, 7168, 4096, 2)]


def layer(num_experts, inter, hidden, top_k, num_tokens, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, device="cuda", generator=gen)
    w13, w2 = (w13 * hidden**-0.5).bfloat16(), (w2 * inter**-0.5).bfloat16()
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    return x, w13, w2, *select_experts(logits, top_k, True)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 64, 257, 2048])
def test_fused_experts_match_the_torch_loop_in_bf16(shape, num_tokens):
    from engine.layers.moe.fused_moe import fused_experts

    x, w13, w2, weights, ids = layer(*shape, num_tokens)
    act = SiluAndMul(fused=True)
    config = default_config(num_tokens, shape[0], shape[3])
    out = fused_experts(x, w13, w2, weights, ids, config, act).float()
    ref = reference_experts(x, w13, w2, weights, ids, act).float()
    # bf16 products rounded at different points: a few bf16 units of O(1) values.
    assert torch.allclose(out, ref, atol=3e-2, rtol=3e-2), (out - ref).abs().max()


def test_a_captured_layer_replays_new_routing():
    from engine.layers.moe.fused_moe import fused_experts

    x, w13, w2, weights, ids = layer(128, 768, 2048, 8, 16)
    act, config = SiluAndMul(fused=True), default_config(16, 128, 8)
    fused_experts(x, w13, w2, weights, ids, config, act)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids, config, act)
    x2, _, _, weights2, ids2 = layer(128, 768, 2048, 8, 16, seed=1)
    for dst, src in ((x, x2), (weights, weights2), (ids, ids2)):
        dst.copy_(src)
    graph.replay()
    ref = fused_experts(x, w13, w2, weights, ids, config, act)
    assert torch.equal(out, ref)


def test_the_tuner_measures_and_records(tmp_path):
    from engine.layers.moe import tune

    out = tmp_path / "moe.json"
    result = tune.main(
        ["--shape", "qwen3-30b-a3b", "--tokens", "1,256", "--budget-s", "2", "--out", str(out)]
    )
    record = json.loads(out.read_text())
    assert record["expert_key"] == "E128_N768_K2048_k8"
    for rec in result["records"].values():
        assert rec["fused_us"] > 0 and rec["floor_us"] > 0 and rec["max_abs_err_vs_reference"] < 0.1


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "mistral", "gemma3"])
def test_cuda_graphs_give_the_eager_engines_tokens(tiny_model, kind):
    """The tiny HF checkpoints in fp32: decode graphs and piecewise graphs (MoE
    layers and sliding windows captured) against the same engine run eagerly."""
    model_dir, _ = tiny_model(kind)
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 500 for i in range(n)]}
        for j, n in enumerate((5, 40, 300))
    ]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens = []
    for eager in (True, False):
        llm = LLM(
            str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
            enforce_eager=eager, gpu_memory_utilization=0.3,
        )  # fmt: skip
        tokens.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[1]
