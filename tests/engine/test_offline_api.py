"""The offline LLM API and the step-level engine API that the nodes drive."""

from __future__ import annotations

import io
import os

import pytest

from engine import LLM, RequestOutputKind, SamplingParams
from tests.engine.conftest import assert_idle

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_prompt_forms_and_output_shape(demo_llm, demo_tokenizer):
    text = "The three primary colors are"
    ids = demo_tokenizer.encode(text)
    outs = demo_llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    first = outs[0]
    assert first.prompt == text and first.prompt_token_ids == ids
    assert first.finished and len(first.outputs) == 1
    c = first.outputs[0]
    assert c.index == 0 and c.finish_reason == "length" and len(c.token_ids) == 8 and c.text
    assert first.metrics.time_to_first_token is not None and first.metrics.time_to_first_token >= 0
    assert outs[1].prompt is None
    # A single list of ints is one prompt; a bare string is one prompt.
    assert len(demo_llm.generate(ids, GREEDY)) == 1
    assert demo_llm.generate(text, GREEDY)[0].outputs[0].token_ids == c.token_ids


def test_outputs_keep_the_prompt_order(demo_llm):
    prompts = [f"Count from {i} to {i + 3}:" for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=2 + i) for i in range(6)]
    outs = demo_llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [2 + i for i in range(6)]
    with pytest.raises(ValueError, match="sampling_params"):
        demo_llm.generate(prompts, params[:2])


def test_chat_applies_the_template(demo_llm, demo_tokenizer):
    conv = [{"role": "user", "content": "What is 2 + 2?"}]
    (out,) = demo_llm.chat(conv, GREEDY)
    expected = demo_tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected
    assert out.prompt_token_ids == demo_tokenizer.encode(expected, add_special_tokens=False)
    (direct,) = demo_llm.generate([expected], GREEDY)
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    batch = demo_llm.chat([conv, [{"role": "user", "content": "Name a planet."}]], GREEDY)
    assert len(batch) == 2 and batch[0].outputs[0].token_ids == out.outputs[0].token_ids


def run_to_completion(engine, kind):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, output_kind=kind)
    engine.add_request("r1", "Tell me a fact about owls.", params)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    return seen


def test_step_api_delta_cumulative_and_final(demo_llm):
    engine = demo_llm.llm_engine
    deltas = run_to_completion(engine, RequestOutputKind.DELTA)
    cumulative = run_to_completion(engine, RequestOutputKind.CUMULATIVE)
    final = run_to_completion(engine, RequestOutputKind.FINAL_ONLY)
    assert len(final) == 1 and final[0].finished
    full = final[0].outputs[0]
    assert len(deltas) == len(cumulative) == 20  # one output per step, one token each
    assert "".join(d.outputs[0].text for d in deltas) == full.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == full.token_ids
    assert cumulative[-1].outputs[0].text == full.text
    assert [len(c.outputs[0].token_ids) for c in cumulative] == list(range(1, 21))
    assert [d.finished for d in deltas] == [False] * 19 + [True]
    assert_idle(demo_llm)


def test_streaming_never_emits_part_of_a_stop_string(demo_llm):
    engine = demo_llm.llm_engine
    (ref,) = demo_llm.generate(
        ["Tell me a fact about owls."],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    )
    stop = ref.outputs[0].text[10:16]
    engine.add_request(
        "s",
        "Tell me a fact about owls.",
        SamplingParams(
            temperature=0,
            max_tokens=20,
            ignore_eos=True,
            stop=stop,
            output_kind=RequestOutputKind.DELTA,
        ),
    )
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text
            assert stop[:2] not in streamed[10:]  # the held-back prefix never leaks
    assert streamed == ref.outputs[0].text[:10]


def test_abort_frees_blocks_at_once_and_reports_abort(demo_llm):
    engine = demo_llm.llm_engine
    long = SamplingParams(
        temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("a", "Write a long story about a dragon.", long)
    engine.add_request("b", "Write a long story about a knight.", long)
    for _ in range(3):
        engine.step()
    bm = engine.block_manager
    assert bm.num_used_blocks > 0
    engine.abort_request("a")
    engine.abort_request(["b", "unknown-id"])
    assert bm.num_used_blocks == 0  # freed before any further step
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert_idle(demo_llm)


def test_duplicate_request_ids_are_rejected(demo_llm):
    engine = demo_llm.llm_engine
    engine.add_request("dup", "hello", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hello again", GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("", "x", GREEDY)
    with pytest.raises(ValueError, match="params"):
        engine.add_request("p", "x", {"temperature": 0})


def test_cache_salt_isolates_prefix_cache(demo_llm):
    engine = demo_llm.llm_engine
    text = "A shared document that two tenants both send, long enough to fill blocks. " * 4
    p = SamplingParams(temperature=0, max_tokens=1)
    demo_llm.generate([{"prompt": text, "cache_salt": "tenant-a"}], p)
    (same,) = demo_llm.generate([{"prompt": text, "cache_salt": "tenant-a"}], p)
    (other,) = demo_llm.generate([{"prompt": text, "cache_salt": "tenant-b"}], p)
    assert same.num_cached_tokens > 32
    assert other.num_cached_tokens == 0
    assert engine.block_manager.num_verification_failures == 0


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_tty(demo_llm, monkeypatch, capsys):
    demo_llm.generate(["a", "b"], GREEDY)
    assert "Processed prompts" not in capsys.readouterr().err  # pytest's stderr is no TTY
    fake = FakeTTY()
    monkeypatch.setattr("sys.stderr", fake)
    demo_llm.generate(["a", "b"], GREEDY)
    assert "Processed prompts" in fake.getvalue() and "tok/s" in fake.getvalue()
    fake2 = FakeTTY()
    monkeypatch.setattr("sys.stderr", fake2)
    demo_llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in fake2.getvalue()


def test_profiler_writes_a_trace(demo_llm, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="profile_dir"):
        monkeypatch.delenv("PDSERVE_TORCH_PROFILER_DIR", raising=False)
        demo_llm.start_profile()
    demo_llm.start_profile(str(tmp_path / "arg"))
    demo_llm.generate(["profile me"], GREEDY)
    demo_llm.stop_profile()
    assert any(f.endswith(".json") or ".pt.trace" in f for f in os.listdir(tmp_path / "arg"))
    monkeypatch.setenv("PDSERVE_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    demo_llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        demo_llm.start_profile()
    demo_llm.stop_profile()
    assert os.listdir(tmp_path / "env")
    with pytest.raises(RuntimeError, match="not running"):
        demo_llm.stop_profile()


def test_invalid_config_is_rejected_before_loading(demo_model_dir):
    with pytest.raises(ValueError, match="kvcache_block_size"):
        LLM(str(demo_model_dir), kvcache_block_size=7)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(demo_model_dir), num_kvcache_blocks=2, max_model_len=1024)
    with pytest.raises(ValueError, match="device 'cuda'"):
        LLM(str(demo_model_dir), device="cuda")
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' cannot run on cpu"):
        LLM(str(demo_model_dir), attention_backend="flash_attn")


def test_skip_tokenizer_init_takes_token_ids(demo_model_dir, demo_tokenizer):
    llm = LLM(str(demo_model_dir), skip_tokenizer_init=True, max_model_len=256)
    ids = demo_tokenizer.encode("The capital of France is")
    (out,) = llm.generate([ids], GREEDY)
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate(["text"], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([ids], SamplingParams(stop=["x"]))


def drain(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_add_request_keeps_a_private_validated_copy_of_params(demo_llm):
    engine = demo_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("copy", "Once upon a time", params)
    params.max_tokens = 2  # the caller reuses its object for something else
    params.repetition_penalty = -1.0
    (out,) = [o for o in drain(engine) if o.finished]
    assert len(out.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine.add_request("bad", "x", params)  # the edited object is checked again


def test_one_token_prompt_has_prompt_logprobs(demo_llm, demo_tokenizer):
    ids = demo_tokenizer.encode("Hi")
    assert len(ids) == 1
    (out,) = demo_llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert out.prompt_logprobs == [None]


def test_delta_with_n_reports_each_finish_once(demo_llm):
    engine = demo_llm.llm_engine
    params = SamplingParams(
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=12,
        stop_token_ids=list(range(0, 49152, 7)),
        prompt_logprobs=1,
        output_kind=RequestOutputKind.DELTA,
    )
    engine.add_request("n3", "Tell me something.", params)
    outs = drain(engine)
    finishes = [(c.index, c.finish_reason) for o in outs for c in o.outputs if c.finish_reason]
    assert sorted(i for i, _ in finishes) == [0, 1, 2]  # each completion's finish exactly once
    assert outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs[1:])  # sent once, with the first delta


def test_hasher_cache_is_bounded(demo_llm):
    from engine.llm_engine import MAX_CACHED_HASHERS

    engine = demo_llm.llm_engine
    p = SamplingParams(max_tokens=1)
    prompts = [{"prompt": "x", "cache_salt": f"tenant-{i}"} for i in range(MAX_CACHED_HASHERS + 20)]
    demo_llm.generate(prompts, p)
    assert len(engine._hashers) == MAX_CACHED_HASHERS
