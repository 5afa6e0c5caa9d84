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
    assert s["paired_ttft_diff_p25_ms"] <= s["median_paired_ttft_diff_ms"]
    assert s["median_paired_ttft_diff_ms"] <= s["paired_ttft_diff_p75_ms"]
    # Every remote request (the warm-up too) crossed the KV channel with its first token.
    assert s["kv_first_tokens"] == s["remote_requests"] == 4
    assert list(tmp_path.glob("disagg_ttft-*.json"))


@pytest.mark.slow
def test_a_run_with_the_prefill_from_the_client_sends_it_beside_the_request(tmp_path):
    record = same_prompt_run(tmp_path, "--prefill-dispatch", "router")
    (run,) = record["results"]["runs"]
    rows, s = run["rows"], run["summary"]
    assert run["prefill_dispatch"] == "router"
    # The first round's went the decode node's way (the prefill node learns its
    # channel so), every later one's from the client, its token on the channel.
    assert s["dispatched_prefills"] == s["remote_requests"] - 1 == 3
    assert s["kv_first_tokens"] == 4
    for row in rows:
        assert row["decode_admit_ms"] == 0  # the Prefill did not wait for the decode node
        assert row["prefill_compute_ms"] > 0  # from the reply, merged as the router does
