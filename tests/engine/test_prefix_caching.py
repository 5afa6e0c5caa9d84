"""Same outputs with prefix caching on and off (with real hits), and under KV pressure
that forces preemption by recompute (greedy identical to an unpressured run)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import assert_idle

SYSTEM = (
    "You are a meticulous assistant for a small public library. You answer questions about "
    "opening hours, borrowing rules, late fees, room bookings and events. Keep every answer "
    "short, polite and factual, and say so when you do not know."
)
QUESTIONS = [
    "When do you open on Saturdays?",
    "How many books can I borrow at once?",
    "What is the late fee for a DVD?",
    "Can I book a study room for four people?",
    "Are there events for children this month?",
    "Do you have a photocopier?",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def uncached_outputs(demo_model_dir, demo_tokenizer):
    llm = LLM(str(demo_model_dir), max_model_len=1024, device="cpu", enable_prefix_caching=False)
    outs = llm.generate(shared_prefix_prompts(demo_tokenizer), GREEDY)
    assert llm.llm_engine.stats().prefix_cache_hit_tokens == 0
    return [o.outputs[0].token_ids for o in outs]


def test_caching_on_and_off_agree_and_really_hit(demo_model_dir, demo_tokenizer, uncached_outputs):
    llm = LLM(str(demo_model_dir), max_model_len=1024, device="cpu", kvcache_block_size=16)
    prompts = shared_prefix_prompts(demo_tokenizer)
    (first,) = llm.generate(prompts[:1], GREEDY)  # fills the cache with the shared prefix
    assert first.num_cached_tokens == 0
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == uncached_outputs
    shared = len(demo_tokenizer.encode(prompts[0][: prompts[0].index(QUESTIONS[0])]))
    expected_hit = (shared // 16) * 16
    assert expected_hit >= 48
    for out in outs[1:]:
        assert out.num_cached_tokens >= expected_hit
    # The repeated first prompt hits all but its last (partial) block.
    assert outs[0].num_cached_tokens == ((len(outs[0].prompt_token_ids) - 1) // 16) * 16
    stats = llm.llm_engine.stats()
    assert stats.prefix_cache_hit_tokens >= expected_hit * len(prompts)
    assert_idle(llm)


def test_prompts_sent_together_compute_their_shared_prefix_once(
    demo_model_dir, demo_tokenizer, uncached_outputs
):
    """On an empty cache, prompts admitted in one step hit the blocks the first of
    them computes in that very step, and read them as computed (outputs as uncached)."""
    llm = LLM(str(demo_model_dir), max_model_len=1024, device="cpu", kvcache_block_size=16)
    prompts = shared_prefix_prompts(demo_tokenizer)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == uncached_outputs
    shared = len(demo_tokenizer.encode(prompts[0][: prompts[0].index(QUESTIONS[0])]))
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= (shared // 16) * 16 >= 48 for o in outs[1:])
    # One step's budget takes every prompt: all were admitted in the first step,
    # so only blocks computed in that same step could be hit.
    assert (
        sum(len(o.prompt_token_ids) for o in outs) <= llm.llm_engine.config.max_num_batched_tokens
    )
    assert_idle(llm)


def pressured_llm(demo_model_dir, demo_tokenizer, caching: bool) -> LLM:
    """A pool that admits three prompts at once but cannot hold them once they grow."""
    lens = [len(demo_tokenizer.encode(p)) for p in shared_prefix_prompts(demo_tokenizer)]
    at_admission = sum(-(-n // 16) for n in lens[:3])
    when_grown = sum(-(-(n + GREEDY.max_tokens) // 16) for n in lens[:3])
    assert when_grown > at_admission + 1
    return LLM(
        str(demo_model_dir),
        device="cpu",
        kvcache_block_size=16,
        max_model_len=max(lens) + GREEDY.max_tokens + 16,
        num_kvcache_blocks=at_admission + 1,
        enable_prefix_caching=caching,
    )


def test_preemption_under_kv_pressure_keeps_outputs(
    demo_model_dir, demo_tokenizer, uncached_outputs
):
    llm = pressured_llm(demo_model_dir, demo_tokenizer, caching=False)
    outs = llm.generate(shared_prefix_prompts(demo_tokenizer), GREEDY)
    assert llm.llm_engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == uncached_outputs
    assert_idle(llm)


def test_preemption_with_caching_recomputes_from_cache(
    demo_model_dir, demo_tokenizer, uncached_outputs
):
    llm = pressured_llm(demo_model_dir, demo_tokenizer, caching=True)
    outs = llm.generate(shared_prefix_prompts(demo_tokenizer), GREEDY)
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == uncached_outputs
    assert_idle(llm)
