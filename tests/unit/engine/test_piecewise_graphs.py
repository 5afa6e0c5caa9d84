"""The piecewise CUDA graphs' switch off the GPU (engine/piecewise_graphs.py;
the graphs themselves: tests/gpu/test_piecewise_graphs_cuda.py)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.piecewise_graphs import piecewise_sizes


def test_sizes_are_capped_by_the_token_budget():
    assert piecewise_sizes(8192) == [16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512]
    assert piecewise_sizes(200) == [16, 32, 48, 64, 96, 128, 160, 192, 200]
    assert piecewise_sizes(64) == [16, 32, 48, 64]
    assert piecewise_sizes(8) == [8]


def test_the_switch_is_ignored_on_a_cpu(tiny_model):
    model_dir, _ = tiny_model("llama")
    config = EngineConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        num_kvcache_blocks=64,
        device="cpu",
        piecewise_cuda_graphs=True,
    )
    assert ModelRunner(config, frozenset()).piecewise is None
