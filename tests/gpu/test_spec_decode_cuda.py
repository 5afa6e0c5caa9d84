"""Speculative decoding on CUDA: verify steps take the multi-token (varlen
prefill) path of the attention backends while plain decode steps replay CUDA
graphs; greedy outputs equal the non-speculative engine's, seeded sampled
ones too; a draft model's sampled proposals go through the rejection
sampler. Run on a GPU host: ``python -m pytest tests/gpu -m gpu``."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.shapes import write_shape_dir
from tests.engine.conftest import assert_idle

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip
# Repeating token patterns: lookup proposes, and a random model's greedy text loops.
PROMPTS = [[(7 * i + j) % 97 + 3 for j in range(12)] * 3 for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_shape_dir("smollm2-135m", str(tmp_path_factory.mktemp("shape")))


def run(model_dir, backend, spec, params, prompts=PROMPTS):
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        attention_backend=backend,
        speculative_config=spec,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_idle(llm)
    stats = llm.llm_engine.stats().spec_decode
    got = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return got, stats


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_and_seeded_equal_non_speculative(model_dir, backend):
    params = [
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=48, ignore_eos=True),
    ] * (len(PROMPTS) // 2)
    ref, _ = run(model_dir, backend, None, params)
    got, stats = run(model_dir, backend, SPEC, params)
    assert got == ref
    assert stats.num_accepted_tokens > 0


def test_a_sampling_draft_is_kept_when_it_is_the_target_and_stays_seeded(model_dir):
    """The model drafting for itself (dummy weights from the same seed) at
    temperature 1: its sampled proposals go through the rejection sampler on
    the device, where p == q keeps (nearly) all of them; seeded requests give
    the same tokens together or alone."""
    draft = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    params = [
        SamplingParams(temperature=1.0, seed=11 + i, max_tokens=32, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    together, stats = run(model_dir, "triton", draft, params)
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.95
    alone, _ = run(model_dir, "triton", draft, params[:1], PROMPTS[:1])
    assert alone[0] == together[0]
