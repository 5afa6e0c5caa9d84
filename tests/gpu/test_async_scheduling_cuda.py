"""Async scheduling on CUDA (the default there) against the synchronous engine:
same weights, same requests, identical results; aborts and preemption leave no
block behind. Run on a GPU host: ``python -m pytest tests/gpu -m gpu``."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.shapes import write_shape_dir
from tests.engine.conftest import assert_idle

pytestmark = pytest.mark.gpu

RNG = random.Random(0)
PROMPTS = [[RNG.randrange(1, 10000) for _ in range(n)] for n in (5, 17, 40, 130, 300, 33)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_shape_dir("smollm2-135m", str(tmp_path_factory.mktemp("shape")))


def make(model_dir, async_scheduling, **kw):
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("gpu_memory_utilization", 0.3)
    return LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        async_scheduling=async_scheduling,
        **kw,
    )


def run_both(model_dir, prompts, params, **kw):
    results = []
    for flag in (False, True):
        llm = make(model_dir, flag, **kw)
        assert llm.llm_engine.async_scheduling is flag
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert_idle(llm)
        results.append(
            [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]
        )
        stats = llm.llm_engine.stats()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return results, stats


def test_async_is_the_cuda_default(model_dir):
    llm = make(model_dir, None)
    assert llm.llm_engine.async_scheduling
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_greedy_seeded_n_logprobs_and_penalties_match_sync(model_dir):
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=33, n=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=25, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.7, seed=1, max_tokens=50, min_tokens=10),
    ]
    (sync, got), _ = run_both(model_dir, PROMPTS, params)
    assert got == sync


def test_stop_ids_and_max_tokens_never_overshoot(model_dir):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = make(model_dir, False)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, base, use_tqdm=False)]
    del llm
    gc.collect()
    params = [base.clone(stop_token_ids=[toks[5]]) for toks in ref]
    (sync, got), _ = run_both(model_dir, PROMPTS, params)
    assert got == sync
    for (c,), toks in zip(got, ref, strict=True):
        assert c[0] == toks[: toks.index(toks[5]) + 1]


def test_abort_with_a_step_in_flight_frees_every_block(model_dir):
    llm = make(model_dir, True)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request([f"r{i}" for i in range(0, len(PROMPTS), 2)])
    engine.step()
    engine.abort_request([f"r{i}" for i in range(1, len(PROMPTS), 2)])
    while engine.has_work():
        engine.step()
    assert_idle(llm)


def test_preemption_under_a_small_pool_completes_everything(model_dir):
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    (sync, got), stats = run_both(
        model_dir, PROMPTS, params, num_kvcache_blocks=40, max_model_len=512
    )
    assert stats.num_preemptions > 0
    assert got == sync


def test_idle_before_a_step_is_the_hosts_delay(model_dir):
    """``InFlightStep.idle_seconds``: a host that waits 30 ms between steps leaves
    the device idle about that long before each (its steps take a few ms); a
    host that does not wait leaves it idle far less. The step log has every
    step's tokens and kind; the first step (queued behind nothing) has no idle."""
    import time

    llm = make(model_dir, True, late_launch=False)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.step()  # the prompts: behind nothing
    for _ in range(3):
        engine.step()  # warm the decode graphs
    first = engine.step_log.take()
    assert first[0].has_prompt_rows and first[0].idle_s is None
    assert first[0].num_tokens == sum(map(len, PROMPTS[:4]))
    for _ in range(6):
        engine.step()
    fast = [r for r in engine.step_log.take() if r.idle_s is not None]
    for _ in range(6):
        time.sleep(0.03)
        engine.step()
    slow = [r for r in engine.step_log.take() if r.idle_s is not None]
    while engine.has_unfinished_requests():
        engine.step()
    assert len(fast) >= 5 and len(slow) >= 5
    assert all(not r.has_prompt_rows and r.num_tokens == 4 for r in fast + slow)
    assert all(r.idle_s >= 0 for r in fast + slow)
    slow_s = sorted(r.idle_s for r in slow)
    assert slow_s[len(slow_s) // 2] >= 0.02, slow
    assert sorted(r.idle_s for r in fast)[len(fast) // 2] < 0.01, fast
