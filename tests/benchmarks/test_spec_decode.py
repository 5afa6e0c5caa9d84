"""The speculative decoding benchmark: the replay proposer's acceptance is what
it is told, greedy outputs stay the non-speculative ones, the n-gram part's
rows are honest, and vLLM's arguments are its names (no vLLM needed)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from types import SimpleNamespace

from benchmarks import spec_decode
from benchmarks.peers import vllm_ngram
from benchmarks.support.edit_workload import (
    EditRequest,
    digest,
    edit_requests,
    paragraphs,
    with_typos,
)


def test_replay_acceptance_is_as_set_and_outputs_stay_greedy(tmp_path):
    record = spec_decode.main(
        [
            "--part", "mechanics", "--device", "cpu", "--shape", "tiny", "--draft-shape", "tiny",
            "--batch-sizes", "2", "--min-prompts", "2", "--input-len", "8",
            "--output-len", "10", "--acceptance", "1,0.5,0", "--num-speculative-tokens", "3",
            "--out-dir", str(tmp_path),
        ]
    )  # fmt: skip
    (path,) = tmp_path.glob("spec_decode-*.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(record))
    rows = record["results"]["rows"]
    replay = {r["acceptance_set"]: r for r in rows if "acceptance_set" in r}
    none, opted_out = rows[0], rows[1]
    assert (none["speculation"], opted_out["speculation"]) == ("none", "opted_out")
    assert len(replay) == 3 and len(rows) == 5
    assert opted_out["outputs_equal_reference"] == 1.0
    full, half, zero = replay[1.0], replay[0.5], replay[0.0]
    assert full["acceptance_rate"] == 1.0 and full["mean_acceptance_length"] > 2
    assert zero["acceptance_rate"] == 0.0 and zero["num_draft_tokens"] > 0
    assert 0.0 < half["acceptance_rate"] < 1.0
    # Whatever is proposed, greedy output is the run without speculation's.
    for row in (full, half, zero):
        assert row["outputs_equal_reference"] == 1.0
        assert row["output_tokens"] == 10 * 2
        assert row["speedup_vs_none"] > 0
    # Accepted runs mean fewer steps for the same tokens.
    assert full["num_drafts"] < half["num_drafts"] < zero["num_drafts"]


def ngram_args(*extra: str) -> argparse.Namespace:
    args = spec_decode.parse_args(["--part", "ngram", "--model", "m", "--device", "cpu", *extra])
    spec_decode.resolve_defaults(args, on_gpu=False)
    return args


def test_ngram_rows_count_proposals_and_keep_greedy_outputs(tmp_path):
    args = ngram_args("--batch-sizes", "1,2", "--min-prompts", "2", "--num-speculative-tokens", "3")
    model_dir = spec_decode.write_shape_dir("tiny", tmp_path)
    rng = random.Random(0)
    # A prompt that repeats itself, so prompt lookup has something to propose.
    work = []
    for _ in range(2):
        text = [rng.randrange(1000) for _ in range(12)]
        work.append(EditRequest(text + text + text[:4], 12))
    family = spec_decode.EngineFamily(
        "pdserve",
        lambda spec: spec_decode.open_pdserve(model_dir, args, True, spec),
        spec_decode.pdserve_generate,
        spec_decode.spec_stats,
        lambda llm: None,
    )
    rows = spec_decode.run_ngram_engine(family, args, work)
    assert [(r["batch_size"], r["speculation"]) for r in rows] == [
        (1, "none"), (2, "none"), (1, "ngram"), (2, "ngram"),
    ]  # fmt: skip
    for r in rows[2:]:
        assert r["num_draft_tokens"] > 0 and 0.0 <= r["acceptance_rate"] <= 1.0
        assert r["outputs_equal_none"] == 1.0 and r["num_speculative_tokens"] == 3
    assert all(r["output_tokens"] == 2 * 12 and r["speedup_vs_none"] > 0 for r in rows)


def test_edit_workload_is_the_docs_with_seeded_typos(demo_tokenizer):
    text = " ".join(paragraphs()[:5])
    typed = with_typos(text, random.Random(1))
    words, typed_words = text.split(" "), typed.split(" ")
    changed = [(a, b) for a, b in zip(words, typed_words, strict=True) if a != b]
    assert changed and len(changed) < len(words) / 4
    assert all(sorted(a) == sorted(b) and a[0] == b[0] and a[-1] == b[-1] for a, b in changed)
    reqs = edit_requests(demo_tokenizer, 3, seed=0)
    assert digest(reqs) == digest(edit_requests(demo_tokenizer, 3, seed=0))
    assert digest(reqs) != digest(edit_requests(demo_tokenizer, 3, seed=1))
    for r in reqs:
        prompt = demo_tokenizer.decode(r.prompt_token_ids)
        assert "Correct the spelling mistakes" in prompt
        assert r.max_tokens > 32 and len(r.prompt_token_ids) > r.max_tokens - 32


def test_vllm_ngram_arguments_and_counters():
    args = ngram_args("--batch-sizes", "1,8,32", "--prompt-lookup-max", "4")
    spec = spec_decode.ngram_config(args, 5)
    assert spec == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }  # fmt: skip
    kwargs = vllm_ngram.engine_kwargs(Path("/m"), args, spec)
    assert kwargs["speculative_config"] is spec and kwargs["max_num_seqs"] == 32
    assert kwargs["enable_prefix_caching"] is False and kwargs["disable_log_stats"] is False
    assert "speculative_config" not in vllm_ngram.engine_kwargs(Path("/m"), args, None)
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens_total", value=6.0),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=4.0),  # another engine
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=3.0),
        SimpleNamespace(name="vllm:num_requests_running", value=9.0),
    ]
    assert vllm_ngram.spec_counters(metrics) == {
        "num_drafts": 0.0, "num_draft_tokens": 10.0, "num_accepted_tokens": 3.0,
    }  # fmt: skip
