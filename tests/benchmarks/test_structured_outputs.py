"""The structured-outputs benchmark runs end to end at a tiny size and writes an
honest record: constrained and unconstrained rows of a batch produce the same
token counts, the constrained tokens are ones the schema's grammar accepts
(checked by a fresh xgrammar matcher), and the compile part covers the test
schema set. vLLM's arguments are checked without vLLM."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from benchmarks import structured_outputs as bench
from benchmarks.peers import vllm_structured
from tests.conftest import TINY_CONFIGS
from tests.integration.structured_schemas import SCHEMAS

xgr = pytest.importorskip("xgrammar")

# A tiny Llama whose vocabulary is padded past the tokenizer's, as the
# Llama-3.1-8B shape's is past the demo tokenizer's.
TINY = {**TINY_CONFIGS["llama"], "vocab_size": 49152 + 64, "torch_dtype": "float32"}


def test_small_run_writes_a_record(tmp_path, demo_model_dir, demo_tokenizer):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    argv = ["--config", str(config), "--tokenizer", str(demo_model_dir), "--device", "cpu"]
    argv += ["--batch-sizes", "1", "3", "--input-len", "8", "--max-tokens", "12"]
    traces = tmp_path / "traces"
    argv += ["--trace-dir", str(traces)]
    record = bench.main([*argv, "--compile-rounds", "1", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("structured_outputs-*.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(record))
    results = record["results"]
    ours = results["pdserve"]
    assert [r["batch"] for r in ours["by_batch"]] == [1, 3]
    for row in ours["by_batch"]:
        assert row["unconstrained_tokens"] == row["constrained_tokens"] == 12 * row["batch"]
    assert all(r["rows_short_of_max_tokens"] == 0 for r in ours["runs"])
    # Every token but a row's first comes from a decode step the engine counted.
    assert all(r["steps"] >= 12 and r["ms_per_step"] > 0 for r in ours["runs"])
    for batch in (1, 3):
        for kind in ("unconstrained", "json_schema"):
            assert (traces / f"batch{batch}-{kind}.json").stat().st_size > 0
            assert "aten::" in (traces / f"batch{batch}-{kind}.txt").read_text()
    assert ours["grammar_compiles"] == 1  # in the warm-up; the timed runs hit the cache
    assert results["tokenizer_vocab"] == len(demo_tokenizer) < ours["vocab_size"]

    compiled = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(demo_tokenizer, vocab_size=TINY["vocab_size"])
    ).compile_json_schema(json.dumps(bench.NESTED_SCHEMA))
    for run in (r for r in ours["runs"] if r["constrained"]):
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in run["first_row_token_ids"]), run
        text = demo_tokenizer.decode(run["first_row_token_ids"])
        assert text.lstrip().startswith("{")

    c = results["compile"]
    assert c["schemas"] == len(SCHEMAS) and c["cold"]["count"] == len(SCHEMAS)
    assert c["cached"]["p99_ms"] < c["cold"]["p50_ms"]  # a cache hit compiles nothing
    assert record["parameters"]["part"] == "all" and results["xgrammar"] == version("xgrammar")


def test_vllm_gets_the_same_call_with_its_tokenizer(tmp_path):
    args = bench.parse_args(["--peer", "vllm", "--batch-sizes", "1", "64", "256"])
    bench.resolve_defaults(args, on_gpu=True)
    kwargs = vllm_structured.structured_engine_kwargs(tmp_path, args)
    assert kwargs["skip_tokenizer_init"] is False and kwargs["load_format"] == "dummy"
    assert kwargs["structured_outputs_config"] == {"backend": "xgrammar"}
    assert kwargs["max_num_seqs"] == 256 and kwargs["model"] == str(tmp_path)
    free, bound = bench.param_kwargs(args, False), bench.param_kwargs(args, True)
    assert free == {**bound, "ignore_eos": True} and bound["max_tokens"] == 512
    with pytest.raises(SystemExit):
        bench.parse_args(["--peer", "vllm", "--part", "compile"])
