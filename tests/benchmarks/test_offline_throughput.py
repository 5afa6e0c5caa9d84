"""The offline-throughput benchmark runs end to end and writes an honest record."""

from __future__ import annotations

import json

from benchmarks import offline_throughput


def test_small_run_with_hf_baseline_writes_a_record(tmp_path):
    record = offline_throughput.main(
        [
            "--shape",
            "smollm2-135m",
            "--num-seqs",
            "3",
            "--min-input-len",
            "8",
            "--max-input-len",
            "24",
            "--min-output-len",
            "4",
            "--max-output-len",
            "12",
            "--device",
            "cpu",
            "--hf-baseline",
            "--out-dir",
            str(tmp_path),
        ]
    )
    files = list(tmp_path.glob("offline_throughput-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved == json.loads(json.dumps(record))
    ours, hf = saved["results"]["pdserve"], saved["results"]["hf_transformers"]
    assert ours["output_tokens"] == hf["useful_output_tokens"]  # same workload on both sides
    assert 4 * 3 <= ours["output_tokens"] <= 12 * 3
    assert hf["generated_tokens"] >= hf["useful_output_tokens"]
    assert saved["results"]["ratio_vs_hf"] == ours["output_tok_per_s"] / hf["output_tok_per_s"]
    assert saved["environment"]["torch"] and "--hf-baseline" in saved["command"]


def test_workload_is_seeded_and_in_range():
    args = offline_throughput.parse_args(["--num-seqs", "50", "--seed", "3"])
    offline_throughput.resolve_defaults(args, on_gpu=True)
    assert (args.shape, args.min_input_len, args.max_input_len) == ("qwen3-0.6b", 100, 1024)
    a = offline_throughput.make_workload(args, 151936)
    b = offline_throughput.make_workload(args, 151936)
    assert a == b
    prompts, outs = a
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outs)
