"""Every supported family against HF transformers on a tiny random model (fp32, CPU).

For each family of tests/conftest.py's TINY_CONFIGS (Llama, Qwen2, Qwen3,
Mistral, Gemma3, Mixtral, Qwen2-MoE, Qwen3-MoE), through the whole engine
(scheduler, paged KV cache, prefix cache, chunked prefill):

- greedy generation, batched, gives HF ``generate``'s tokens;
- teacher-forced on prompt + HF's continuation, our top-1 token at every
  position (``prompt_logprobs``) is HF's argmax: 100% agreement;
- the sliding-window families run prompts and continuations longer than their
  windows (12 tokens for Mistral, 8 for Gemma3's sliding layers).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import TINY_CONFIGS, hf_greedy_ids
from tests.engine.conftest import assert_idle

KINDS = list(TINY_CONFIGS)
NEW_TOKENS = 20
# Token-id prompts of varied lengths, most longer than the sliding windows.
PROMPTS = [[(i * 37 + 11 * j) % 500 + 3 for i in range(n)] for j, n in enumerate((5, 27, 60))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: one thread is several times faster than two on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def family(tiny_model, request):
    """(LLM, HF model, HF's greedy continuations) of one family, for the module."""
    model_dir, hf = tiny_model(request.param)
    llm = LLM(
        str(model_dir),
        skip_tokenizer_init=True,
        device="cpu",
        max_model_len=256,
        kvcache_block_size=8,
        enable_chunked_prefill=True,
        max_num_seqs=8,
        max_num_batched_tokens=48,  # the 60-token prompt is computed in chunks
    )
    return llm, hf, [hf_greedy_ids(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("family", KINDS, indirect=True)
def test_batched_greedy_equals_transformers(family):
    llm, _, want = family
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert sum(len(w) == NEW_TOKENS for w in want) >= 2  # most run to the length limit
    assert_idle(llm)


@pytest.mark.parametrize("family", KINDS, indirect=True)
def test_teacher_forced_top1_agrees_everywhere(family):
    llm, hf, continuations = family
    seqs = [p + c for p, c in zip(PROMPTS, continuations, strict=True)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    agree = total = 0
    for seq, out in zip(seqs, outs, strict=True):
        with torch.inference_mode():
            hf_top = hf(torch.tensor([seq])).logits[0].argmax(-1).tolist()
        for pos in range(1, len(seq)):
            ours = next(t for t, lp in out.prompt_logprobs[pos].items() if lp.rank == 1)
            agree += ours == hf_top[pos - 1]
            total += 1
        # The position after the last one: the sampled token.
        agree += out.outputs[0].token_ids[0] == hf_top[-1]
        total += 1
    assert agree == total, f"{agree}/{total} positions agree"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_all_sliding_model_frees_blocks_behind_its_window_and_still_equals_hf(
    tiny_model, async_scheduling
):
    """Mistral (every layer slides, window 12): three 40-token prompts generating
    40 tokens each need 30 blocks of 8 whole, but a 14-block pool serves them
    without preemption, since the blocks behind each window go back as the
    sequences advance."""
    model_dir, hf = tiny_model("mistral")
    prompts = [[(i * 13 + 7 * j) % 500 + 3 for i in range(40)] for j in range(3)]
    want = [hf_greedy_ids(hf, p, 40) for p in prompts]
    llm = LLM(
        str(model_dir),
        skip_tokenizer_init=True,
        device="cpu",
        max_model_len=96,
        kvcache_block_size=8,
        num_kvcache_blocks=14,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(temperature=0, max_tokens=40)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions == 0 and stats.num_window_freed_blocks >= 20
    assert_idle(llm)


def test_gemma3s_global_layers_keep_every_block(family_gemma3):
    """Interleaved sliding and global layers: the global ones read the whole
    context, so nothing is freed (docs/architecture.md, Models)."""
    llm = family_gemma3
    assert llm.llm_engine.scheduler.sliding_window is None
    assert llm.llm_engine.stats().num_window_freed_blocks == 0


@pytest.fixture
def family_gemma3(tiny_model):
    model_dir, _ = tiny_model("gemma3")
    llm = LLM(str(model_dir), skip_tokenizer_init=True, device="cpu", max_model_len=128)
    llm.generate(
        [{"prompt_token_ids": list(range(3, 60))}], SamplingParams(max_tokens=30), use_tqdm=False
    )
    return llm
