"""Tensor parallelism on the CPU: ranks in their own processes over gloo.

The demo model (9 heads, 3 KV heads) at ``tensor_parallel_size=3`` is held to
HF transformers' greedy tokens (batched, with prefix-cache hits and with
preemption under a small pool) and to TP = 1's logprobs and seeded samples; a
dummy-weight config with 8 heads and 2 KV heads gives the same greedy tokens
at TP = 1 and 4 (each KV head replicated on two ranks; the
families below cover TP = 2's one head a rank); so do the tiny
MoE families and Gemma3 (from HF checkpoints). A rank that dies is named in
the error; shutdown stops every rank.
"""

from __future__ import annotations

import json
import time

import pytest

from engine import LLM, SamplingParams
from engine.tp_workers import TensorParallelError
from tests.conftest import hf_greedy_ids
from tests.engine.conftest import assert_idle

NEW_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="module")
def tp3(demo_model_dir):
    llm = LLM(
        str(demo_model_dir),
        max_model_len=512,
        device="cpu",
        tensor_parallel_size=3,
        worker_extension_cls="tests.engine.tp_probe:Probe",
    )
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def hf_greedy(hf_demo, parity_prompts) -> list[list[int]]:
    return [hf_greedy_ids(hf_demo, ids, NEW_TOKENS) for ids in parity_prompts]


def test_tp3_batched_greedy_equals_transformers_and_again_from_the_cache(
    tp3, parity_prompts, hf_greedy
):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    first = tp3.generate(parity_prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == hf_greedy
    hits = tp3.llm_engine.stats().prefix_cache_hit_tokens
    again = tp3.generate(parity_prompts, params, use_tqdm=False)
    assert tp3.llm_engine.stats().prefix_cache_hit_tokens > hits  # served from the cache
    assert [o.outputs[0].token_ids for o in again] == hf_greedy
    assert_idle(tp3)


def test_tp3_logprobs_prompt_logprobs_and_seeded_samples_match_tp1(tp3, demo_llm):
    params = [
        SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, n=2),
    ]
    for p in params:
        want = demo_llm.generate(PROMPTS, p, use_tqdm=False)
        got = tp3.generate(PROMPTS, p, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            if p.logprobs:
                for wl, gl in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                    assert set(wl) == set(gl)
                    for tok in wl:
                        assert gl[tok].logprob == pytest.approx(wl[tok].logprob, abs=1e-4)
            if p.prompt_logprobs:
                assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
                for wl, gl in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
                    for tok in wl:
                        assert gl[tok].logprob == pytest.approx(wl[tok].logprob, abs=1e-4)
    assert_idle(tp3)


def _lines(path, count: int, timeout_s: float = 30.0) -> list[dict]:
    """The probe's records once ``count`` are written (followers run calls on their own time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)
    raise AssertionError(f"{path}: fewer than {count} records after {timeout_s} s")


def test_worker_extension_calls_run_on_every_other_rank_in_order_with_the_steps(tp3, tmp_path):
    engine = tp3.llm_engine
    path = tmp_path / "calls.jsonl"
    layers = list(range(engine.config.model_config.num_hidden_layers))

    class RankZero:  # rank 0's own observer: the step then runs layer by layer everywhere
        def begin_step(self, batch):
            return lambda layer: None

        def step_sampled(self, token_ids, rows):
            pass  # only rank 0 samples; this test watches the other ranks

    engine.call_workers("record", {"path": str(path), "tag": "first"})
    engine.call_workers("watch_layers", {"path": str(path)})
    engine.observe_kv_writes(RankZero())
    try:
        out = tp3.generate(
            ["The capital of France is"], SamplingParams(max_tokens=3), use_tqdm=False
        )
    finally:
        engine.observe_kv_writes(None)
    engine.call_workers("unwatch", {})
    engine.call_workers("record", {"path": str(path), "tag": "last"})
    tp3.generate(["again"], SamplingParams(max_tokens=2), use_tqdm=False)  # not watched
    records = _lines(path, 2 * (1 + 3 + 1))
    assert len(out[0].outputs[0].token_ids) == 3
    for rank, heads in ((1, [1]), (2, [2])):
        mine = [r for r in records if r["rank"] == rank]
        assert [r["tag"] for r in mine] == ["first", "step", "step", "step", "last"]
        assert mine[0]["kv_heads"] == heads
        assert all(r["layers"] == layers for r in mine[1:4])


def test_tp3_async_scheduling_under_preemption_completes_everything(demo_model_dir, demo_llm):
    # Async scheduling: the previous step's samples reach the other ranks by a
    # device broadcast of the input ids; a 9-block pool forces preemption.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = demo_llm.generate(PROMPTS, params, use_tqdm=False)
    small = LLM(
        str(demo_model_dir),
        max_model_len=128,
        device="cpu",
        async_scheduling=True,
        num_kvcache_blocks=9,
        tensor_parallel_size=3,
    )
    try:
        got = small.generate(PROMPTS, params, use_tqdm=False)
        assert small.llm_engine.stats().num_preemptions > 0
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert_idle(small)
    finally:
        small.llm_engine.shutdown()


def test_tp2_is_refused_for_nine_heads(demo_model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the model's 9"):
        LLM(str(demo_model_dir), device="cpu", tensor_parallel_size=2)


DUMMY_8_HEADS = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 501,  # not a multiple of 4: the last vocabulary shard is padded
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}


def test_dummy_weights_give_the_same_greedy_tokens_at_tp_1_and_4(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DUMMY_8_HEADS))
    prompts = [{"prompt_token_ids": list(range(7 * i, 7 * i + 5 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for tp in (1, 4):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            skip_tokenizer_init=True,
            device="cpu",
            max_model_len=128,
            tensor_parallel_size=tp,
        )
        try:
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert_idle(llm)
        finally:
            llm.llm_engine.shutdown()
    assert tokens[4] == tokens[1]
    assert len({tuple(t) for t in tokens[1]}) > 1  # not one degenerate answer


@pytest.mark.parametrize(
    "kind, sizes",
    [("qwen3_moe", (2,)), ("mixtral", (4,)), ("qwen2_moe", (2,)), ("gemma3", (2,))],
)
def test_tiny_families_give_tp1s_greedy_tokens_and_logprobs_at_tp_2_and_4(tiny_model, kind, sizes):
    """MoE layers split each expert's intermediate dimension (and the shared
    expert's) over the ranks; Gemma3 its sliding and global layers' heads."""
    model_dir, _ = tiny_model(kind)
    prompts = [
        {"prompt_token_ids": [(7 * i + 3 * j) % 500 for i in range(n)]}
        for j, n in enumerate((6, 23, 41))
    ]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    results = {}
    for tp in (1, *sizes):
        llm = LLM(
            str(model_dir),
            skip_tokenizer_init=True,
            device="cpu",
            max_model_len=128,
            tensor_parallel_size=tp,
        )
        try:
            results[tp] = llm.generate(prompts, params, use_tqdm=False)
            assert_idle(llm)
        finally:
            llm.llm_engine.shutdown()
    want = [o.outputs[0] for o in results[1]]
    for tp in sizes:
        got = [o.outputs[0] for o in results[tp]]
        assert [c.token_ids for c in got] == [c.token_ids for c in want], f"tp={tp}"
        for g, w in zip(got, want, strict=True):
            for gl, wl in zip(g.logprobs, w.logprobs, strict=True):
                for tok in wl:
                    assert gl[tok].logprob == pytest.approx(wl[tok].logprob, abs=1e-4)


def test_a_dead_rank_is_named_and_shutdown_stops_the_rest(demo_model_dir):
    llm = LLM(str(demo_model_dir), max_model_len=256, device="cpu", tensor_parallel_size=3)
    workers = llm.llm_engine.tp_workers
    params = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    victim = workers.procs[1]  # rank 2
    victim.kill()
    victim.wait()
    with pytest.raises(TensorParallelError, match=rf"rank 2 \(pid {victim.pid}\) exited"):
        llm.generate(["Hello again"], params, use_tqdm=False)
    # The engine stopped the survivor on the way out.
    assert workers.procs[0].wait(timeout=15) is not None


def test_a_call_that_fails_on_a_rank_ends_that_rank_and_the_engine_names_it(demo_model_dir):
    llm = LLM(
        str(demo_model_dir),
        max_model_len=256,
        device="cpu",
        tensor_parallel_size=3,
        worker_extension_cls="tests.engine.tp_probe:Probe",
    )
    workers = llm.llm_engine.tp_workers
    try:
        llm.llm_engine.call_workers("record", {})  # no "path": a KeyError on ranks 1 and 2
        with pytest.raises(TensorParallelError, match=r"rank \d \(pid \d+\) exited with code 1"):
            llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert all(p.poll() is not None for p in workers.procs)


def test_shutdown_stops_every_rank_cleanly(tp3):
    """Last in the module: the shared TP = 3 engine, after everything it served."""
    procs = list(tp3.llm_engine.tp_workers.procs)
    assert all(p.poll() is None for p in procs)
    tp3.llm_engine.shutdown()
    assert [p.wait(timeout=15) for p in procs] == [0, 0]
