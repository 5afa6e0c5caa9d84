"""benchmarks/online_ttft.py on the CPU: every request counted, its first token split."""

from __future__ import annotations

import json

from benchmarks import online_ttft


def test_a_small_run_splits_every_first_token_and_writes_a_record(tmp_path):
    argv = ["--shape", "tiny", "--device", "cpu", "--request-rate", "50", "20"]
    argv += ["--num-prompts", "8", "--groups", "2", "--prompts-per-group", "4"]
    argv += ["--system-len", "48", "--question-len", "8", "--output-len", "4"]
    argv += ["--switch-interval-ms", "2", "--out-dir", str(tmp_path)]
    results = online_ttft.main(argv)
    assert [r["request_rate"] for r in results["rates"]] == [50, 20]
    assert results["switch_interval_ms"] == 2.0
    for row in results["rates"]:
        assert row["num_prompts"] == 8
        for part in ("ttft_ms", "handoff_ms", "queued_ms", "computed_ms", "delivered_ms"):
            assert row[part]["count"] == 8 and row[part]["p50_ms"] >= 0, part
        # The parts are consecutive stretches of the whole: their means add up.
        parts = ("handoff_ms", "queued_ms", "computed_ms", "delivered_ms")
        total = sum(row[p]["mean_ms"] for p in parts)
        assert abs(total - row["ttft_ms"]["mean_ms"]) < 1e-6
        assert row["computed_ms"]["p50_ms"] > 0  # a forward pass happened
        assert row["tpot_ms"]["count"] == 8  # 4 tokens each: every request has a TPOT
    (record,) = tmp_path.glob("online_ttft-*.json")
    assert json.loads(record.read_text())["results"]["rates"][1]["num_prompts"] == 8
