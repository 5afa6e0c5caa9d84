"""Multi-LoRA on a GPU: the Triton shrink / expand against the torch path, and
the engine's mixed-adapter batches against HF + PEFT, with CUDA graphs replaying
decode steps that mix adapters.

Run on a GPU host: ``python -m pytest tests/gpu/test_lora_cuda.py -m gpu``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.lora.punica import LoRABatch, expand, shrink
from tests.conftest import hf_greedy_ids
from tests.engine.test_lora import _prompts, make_lora_setup

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    return make_lora_setup(tiny_model, tmp_path_factory)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_triton_shrink_expand_equal_the_torch_path(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    loras, rank, slices, k = 4, 16, (96, 32, 32), 200
    x = torch.randn(num_tokens, k, generator=gen).to("cuda", dtype)
    a = torch.randn(loras, len(slices) * rank, k, generator=gen).to("cuda", dtype)
    bs = [torch.randn(loras, n, rank, generator=gen).to("cuda", dtype) for n in slices]
    slots = torch.randint(-1, loras, (num_tokens,), generator=gen).numpy().astype(np.int32)
    slots_dev = torch.from_numpy(slots).cuda()
    results = []
    for use_triton in (False, True):
        batch = LoRABatch.build(slots, slots_dev, use_triton)
        y = torch.randn(num_tokens, sum(slices), generator=torch.Generator().manual_seed(1))
        y = y.to("cuda", dtype)
        u = shrink(x, a, batch)
        offset = 0
        for i, b in enumerate(bs):
            expand(y, u[:, i * rank : (i + 1) * rank], b, batch, offset)
            offset += b.shape[1]
        results.append((u, y))
    (u_ref, y_ref), (u_tri, y_tri) = results
    tol = 1e-3 if dtype is torch.float32 else 3e-2
    assert torch.allclose(u_tri, u_ref, rtol=tol, atol=tol * 10)
    assert torch.allclose(y_tri.float(), y_ref.float(), rtol=tol, atol=tol * 30)
    assert (u_tri[torch.from_numpy(slots < 0).cuda()] == 0).all()


def _mixed(setup, **kwargs):
    model_dir, _, adapters = setup
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=256,
              skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8, max_loras=3,
              num_kvcache_blocks=128, **kwargs)  # fmt: skip
    loras = [None] + [r for r, _ in adapters]
    prompts = _prompts(8)
    per_prompt = [loras[i % 4] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    return llm, prompts, llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)


def test_engine_on_cuda_equals_hf_peft(lora_setup):
    _, hf_base, adapters = lora_setup
    oracles = [hf_base] + [m for _, m in adapters]
    llm, prompts, outs = _mixed(lora_setup, attention_backend="torch")
    assert llm.llm_engine.model_runner.lora.use_triton
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        want = hf_greedy_ids(oracles[i % 4], prompt, 8)
        assert out.outputs[0].token_ids == want, f"prompt {i}"


def test_cuda_graphs_replay_decode_steps_that_mix_adapters(lora_setup):
    eager, _, want = _mixed(lora_setup, attention_backend="triton", enforce_eager=True,
                            piecewise_cuda_graphs=False)  # fmt: skip
    del eager
    llm, _, got = _mixed(lora_setup, attention_backend="triton")
    runner = llm.llm_engine.model_runner
    assert runner.graphs is not None and runner.lora.in_graphs
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda inputs: calls.append(1) or run(inputs)
    _, _, again = _mixed_again(llm, lora_setup)
    assert calls, "no decode step replayed a graph"
    for w, g, a in zip(want, got, again, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert a.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            tok = next(iter(lw))
            assert lg[tok].logprob == pytest.approx(lw[tok].logprob, abs=1e-3)


def _mixed_again(llm, setup):
    _, _, adapters = setup
    loras = [None] + [r for r, _ in adapters]
    prompts = _prompts(8)
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0)
    per_prompt = [loras[i % 4] for i in range(8)]
    return llm, prompts, llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
