"""The start-up warm-up passes (engine/kernel_warmup.py), run here on the CPU:
which passes fit, and that the blocks they write change no request's output
(on a GPU the same passes compile the kernels: tests/gpu/test_kernel_warmup_cuda.py)."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from engine.kernel_warmup import WARMUP_PASSES, warm_up_kernels
from engine.models.shapes import write_shape_dir

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 60)), [3] * 19]


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Dummy weights of a shape whose positions reach the 2,048-token passes.
    return write_shape_dir("tiny", str(tmp_path_factory.mktemp("tiny-shape")))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cpu",
        max_model_len=2048 + 64,
        num_kvcache_blocks=512,
        max_num_batched_tokens=512,
    )


def test_every_pass_that_fits_runs(llm, caplog):
    with caplog.at_level(logging.INFO, logger="engine.kernel_warmup"):
        warm_up_kernels(llm.llm_engine.model_runner)
    assert f"kernel warm-up: {len(WARMUP_PASSES)} of {len(WARMUP_PASSES)} passes" in caplog.text


def test_passes_that_do_not_fit_are_skipped(model_dir, caplog):
    small = LLM(
        str(model_dir), load_format="dummy", skip_tokenizer_init=True, device="cpu", max_model_len=256,
        num_kvcache_blocks=64, max_num_batched_tokens=256,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="engine.kernel_warmup"):
        warm_up_kernels(small.llm_engine.model_runner)
    # Only the passes without a context over 256 tokens: 16, 64 and (16, 1) tokens.
    assert f"kernel warm-up: 3 of {len(WARMUP_PASSES)} passes" in caplog.text


def test_the_blocks_it_writes_change_no_output(llm):
    before = greedy(llm)
    llm.llm_engine.reset_prefix_cache()
    warm_up_kernels(llm.llm_engine.model_runner)  # garbage into free blocks
    assert greedy(llm) == before


def test_a_moe_model_runs_each_fused_kernel_config_once(tmp_path, monkeypatch, caplog):
    """The fused MoE kernel's tiles follow the step's token count: the warm-up
    calls the experts once per config a step up to the token budget picks."""
    pytest.importorskip("triton", reason="triton is not installed")
    from engine.layers.moe.layer import FusedMoE
    from tests.conftest import TINY_CONFIGS, write_config_dir

    model_dir = write_config_dir(tmp_path / "moe", TINY_CONFIGS["mixtral"])
    llm = LLM(
        str(model_dir), load_format="dummy", skip_tokenizer_init=True, device="cpu",
        max_model_len=128, num_kvcache_blocks=64, max_num_batched_tokens=128, max_num_seqs=16,
    )  # fmt: skip
    runner = llm.llm_engine.model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    calls = []
    for layer in layers:
        layer.use_triton = True  # as on a GPU (the interpreter runs it here)
    first = layers[0]
    experts = first.experts

    def counted(x, weights, ids):
        calls.append(first.kernel_config(x.shape[0]))
        return experts(x, weights, ids)

    monkeypatch.setattr(first, "experts", counted)
    with caplog.at_level(logging.INFO, logger="engine.kernel_warmup"):
        warm_up_kernels(runner)
    configs = {first.kernel_config(m) for m in range(1, 129)}
    assert len(configs) > 1  # the budget spans several tile sizes
    assert set(calls) == configs  # the forward passes, then one call per config
    assert f"{len(configs)} fused-MoE configs" in caplog.text
