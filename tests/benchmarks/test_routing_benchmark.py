"""benchmarks/routing.py: its bound is a real bound, and both parts run end to end."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from benchmarks import routing
from benchmarks.routing import Turn, best_possible


def test_best_possible_credits_only_requests_sent_before_the_first_token():
    a = list(range(100, 164))  # 64 tokens: 4 blocks of 16
    reply = list(range(500, 520))
    first = Turn(0, 0, a, sent=0.0, done=1.0, output=reply, ttft_ms=600.0)
    # The next turn may reuse `first`'s prompt and reply (5 full blocks), but
    # never its own last prompt token.
    follow = Turn(0, 1, a + reply + [7] * 30, sent=2.0, done=3.0, ttft_ms=100.0)
    # Sent after `first`, answered before it: `first`'s blocks could be there.
    during = Turn(1, 0, a + [9] * 10, sent=0.1, done=0.5, ttft_ms=200.0)
    # A request with nobody sent before its first token: nothing to reuse.
    alone = Turn(2, 0, [5] * 40, sent=0.0, done=0.2, ttft_ms=50.0)
    # The same prompt again, later: all but the last block-aligned token.
    again = Turn(3, 0, list(a), sent=4.0, done=5.0, ttft_ms=100.0)
    bounds = best_possible([first, follow, during, alone, again], 16)
    assert bounds == [48, 80, 64, 0, 48]
    # `first` is credited with `during`'s blocks (sent before its first
    # token): generous, never below what a real cache could serve.


@pytest.mark.timeout(600)
def test_both_parts_run_and_write_a_record(demo_model_dir, tmp_path):
    record = routing.main(
        [
            "--model",
            str(demo_model_dir),
            "--prefill",
            "1",
            "--decode",
            "2",
            "--systems",
            "1",
            "--system-tokens",
            "64",
            "--users",
            "3",
            "--turns",
            "2",
            "--min-user-tokens",
            "8",
            "--max-user-tokens",
            "16",
            "--output-tokens",
            "4",
            "--concurrency",
            "3",
            "--max-model-len",
            "512",
            "--decision-prompt-tokens",
            "1024",
            "--other-blocks",
            "500",
            "--decisions",
            "50",
            "--out-dir",
            str(tmp_path),
        ]
    )
    saved = json.loads(next(tmp_path.glob("routing-*.json")).read_text())
    assert saved == json.loads(json.dumps(record))
    d = saved["results"]["decision"]
    assert d["redis_round_trips_per_decision"] == 1 and d["hits_agree_with_linear_scan"]
    assert d["blocks"] == 64 and d["decision_including_hashing"]["count"] == 50
    w = saved["results"]["workload"]
    for policy in ("random", "round-robin", "cost"):
        r = w[policy]
        assert r["requests"] == 6 and r["output_tokens"] == 24
        assert 0 <= r["cached_tokens"] <= r["best_cached_tokens"] <= r["prompt_tokens"]
    # Turn 2 of each conversation extends turn 1: the bound is never zero here.
    assert w["cost"]["best_cached_tokens"] > 0


def test_a_router_that_exits_fails_the_start_at_once_and_none_is_left(demo_model_dir, tmp_path):
    """A bad flag: each router exits 2. The start fails within seconds, not after
    its 120 s deadline, and nothing is left running. (The kill of routers still
    alive when another fails is not reached here: every router gets the flag.)"""

    class NoCluster:
        redis_url = "redis://127.0.0.1:1/0"  # never reached: the flag is refused first

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="router did not start"):
        routing.start_routers(
            NoCluster(), ["random", "cost"], str(demo_model_dir), str(tmp_path), ["--no-such-flag"]
        )
    assert time.monotonic() - started < 60
    assert "--no-such-flag" in (tmp_path / "router-random.log").read_text()
    left = subprocess.run(["pgrep", "-f", "--", "--no-such-flag"], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
