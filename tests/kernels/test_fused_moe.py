"""The fused MoE kernel (engine/layers/moe/fused_moe.py) against the torch loop.

Without a GPU it runs under Triton's interpreter at tiny sizes (fp32); on a GPU
host tests/gpu/test_fused_moe_cuda.py runs it at the real models' shapes.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.moe.configs import MoeKernelConfig, default_config
from engine.layers.moe.reference import moe_align_reference, reference_experts
from engine.layers.moe.routing import select_experts

fm = pytest.importorskip("engine.layers.moe.fused_moe", reason="triton is not installed")
dispatch = pytest.importorskip("engine.layers.moe.dispatch", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(num_tokens, hidden, inter, num_experts, top_k, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

    x = rand(num_tokens, hidden)
    w13 = rand(num_experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = rand(num_experts, hidden, inter, scale=inter**-0.5)
    weights, ids = select_experts(rand(num_tokens, num_experts, scale=3.0), top_k, True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("align", ["triton", "torch"])
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, block_m",
    [(1, 4, 2, 16), (37, 8, 3, 16), (9, 5, 1, 32), (700, 128, 8, 64)],
)
def test_align_groups_every_pair_once_in_tiles_of_one_expert(
    align, num_tokens, num_experts, top_k, block_m
):
    ids = torch.randint(0, num_experts, (num_tokens, top_k), dtype=torch.int32, device=DEVICE)
    ids[0, 0] = -1  # an expert held by another rank
    fn = dispatch.moe_align if align == "triton" else moe_align_reference
    sorted_ids, expert_ids, num_padded = fn(ids, num_experts, block_m)
    pairs = num_tokens * top_k
    n = int(num_padded)
    flat = ids.reshape(-1).long().cpu()
    counts = torch.bincount(torch.where(flat < 0, num_experts, flat), minlength=num_experts + 1)
    assert n == int(((counts + block_m - 1) // block_m * block_m).sum())
    sorted_ids, expert_ids = sorted_ids.cpu(), expert_ids.cpu()
    real = sorted_ids[:n][sorted_ids[:n] < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    assert (sorted_ids[n:] == pairs).all()  # the rest is padding
    for t in range(n // block_m):
        tile = sorted_ids[t * block_m : (t + 1) * block_m].long()
        tile = tile[tile < pairs]
        want = expert_ids[t].item()
        assert len(tile) > 0  # a tile of padding only is never computed
        assert ((flat[tile] == want) | ((flat[tile] < 0) & (want == -1))).all()


@pytest.mark.parametrize(
    "num_experts, top_k, renorm", [(8, 2, True), (60, 4, False), (128, 8, True)]
)
def test_fused_topk_picks_what_torch_picks(num_experts, top_k, renorm):
    logits = torch.randn(33, num_experts, device=DEVICE) * 3
    weights, ids = dispatch.fused_topk(logits, top_k, renorm)
    ref_w, ref_ids = select_experts(logits, top_k, renorm)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(weights, ref_w, atol=1e-6, rtol=1e-5)


CASES = [
    # (tokens, hidden, expert intermediate, experts, top-k, config or None: the default)
    (1, 64, 32, 4, 2, None),
    (5, 64, 48, 8, 2, MoeKernelConfig(16, 32, 32)),  # K = 48: not a multiple of the tile
    (37, 32, 32, 4, 3, MoeKernelConfig(32, 32, 16, group_m=2)),
    (64, 64, 32, 8, 2, None),
]


@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k, config", CASES)
def test_fused_experts_match_the_torch_loop(num_tokens, hidden, inter, num_experts, top_k, config):
    x, w13, w2, weights, ids = routed(num_tokens, hidden, inter, num_experts, top_k)
    config = config or default_config(num_tokens, num_experts, top_k)
    act = SiluAndMul()
    out = fm.fused_experts(x, w13, w2, weights, ids, config, act)
    ref = reference_experts(x, w13, w2, weights, ids, act)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()


def test_experts_held_elsewhere_add_nothing_and_the_ranks_sum_to_the_whole():
    """Expert parallelism's hook: a rank maps the ids of experts it does not hold
    to -1; two ranks holding half the experts each sum to the full layer."""
    x, w13, w2, weights, ids = routed(23, 64, 32, 8, 2, seed=3)
    config, act = MoeKernelConfig(16, 32, 32), SiluAndMul()
    full = fm.fused_experts(x, w13, w2, weights, ids, config, act)
    parts = []
    for lo in (0, 4):
        local = torch.where((ids >= lo) & (ids < lo + 4), ids - lo, -1).to(torch.int32)
        part = fm.fused_experts(x, w13[lo : lo + 4], w2[lo : lo + 4], weights, local, config, act)
        ref = reference_experts(x, w13[lo : lo + 4], w2[lo : lo + 4], weights, local, act)
        assert torch.allclose(part, ref, atol=1e-5, rtol=1e-4)
        parts.append(part)
    assert torch.allclose(parts[0] + parts[1], full, atol=1e-5, rtol=1e-4)


def test_no_tokens():
    x, w13, w2, weights, ids = routed(0, 32, 16, 4, 2)
    assert fm.fused_experts(
        x, w13, w2, weights, ids, default_config(0, 4, 2), SiluAndMul()
    ).shape == (0, 32)


def test_configs_come_from_the_gpu_table_else_the_default(tmp_path, monkeypatch):
    from engine.layers.moe import configs

    table = {
        "bfloat16": {
            "E8_N32_K64_k2": {
                "16": {"config": MoeKernelConfig(32, 64, 64).to_dict()},
                "128": {"config": MoeKernelConfig(64, 128, 64, 8).to_dict()},
            }
        }
    }
    (tmp_path / "Some_GPU.json").write_text(json.dumps(table))
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.load_table.cache_clear()
    pick = configs.config_for
    assert pick("Some GPU", "bfloat16", 4, 8, 32, 64, 2) == MoeKernelConfig(32, 64, 64)
    assert pick("Some GPU", "bfloat16", 100, 8, 32, 64, 2).block_m == 64
    assert pick("Some GPU", "bfloat16", 4000, 8, 32, 64, 2).block_m == 64  # the largest
    assert pick("Other GPU", "bfloat16", 4, 8, 32, 64, 2) == default_config(4, 8, 2)
    assert pick("Some GPU", "float16", 4, 8, 32, 64, 2) == default_config(4, 8, 2)
    configs.load_table.cache_clear()
