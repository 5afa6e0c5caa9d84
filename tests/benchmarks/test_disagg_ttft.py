"""benchmarks/disagg_ttft.py on a CPU: a real cluster (gloo KV channels), the same
prompt on both paths, and what the run reports about it."""

from __future__ import annotations

import pytest

from benchmarks.disagg_ttft import main


def test_the_same_prompt_needs_a_decode_node_per_path():
    # With one decode node the local request would hit the disaggregated one's cache.
    with pytest.raises(SystemExit):
        main(["--shape", "tiny", "--same-prompt"])


def same_prompt_run(tmp_path, *extra: str) -> dict:
    """A short run on a tiny shape: 3 rounds after 1 warm-up, the same prompt on both paths."""
    return main(
        ["--shape", "tiny", "--prompt-tokens", "64", "--requests", "3", "--warmup", "1"]
        + ["--local-gpu", "prefill", "--same-prompt", "--out-dir", str(tmp_path), *extra]
    )


@pytest.mark.slow
def test_a_same_prompt_run_pairs_the_paths_round_by_round(tmp_path):
    record = same_prompt_run(tmp_path)
    assert record["parameters"]["same_prompt"] is True
    (run,) = record["results"]["runs"]
    rows, s = run["rows"], run["summary"]
    assert len(rows) == 3
    for row in rows:
        assert row["direct_cached_tokens"] == row["local_cached_tokens"] == 0
        assert row["paired_ttft_diff_ms"] == pytest.approx(
            row["direct_ttft_ms"] - row["local_ttft_ms"]
        )
        # The direct path is the router's: the decode node's admission and its
        # wait for the KV, and the prefill node's figures from its reply.
        assert row["decode_admit_ms"] > 0 and row["kv_wait_ms"] > 0
        assert row["prefill_compute_ms"] > 0 and row["prefill_node_ms"] > 0
    assert s["paired_ttft_diff_p25_ms"] <= s["median_paired_ttft_diff_ms"]
    assert s["median_paired_ttft_diff_ms"] <= s["paired_ttft_diff_p75_ms"]
    assert s["remote_requests"] == 4
    assert list(tmp_path.glob("disagg_ttft-*.json"))
