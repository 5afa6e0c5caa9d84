"""The router's request statistics and pdctl's output formats."""

from __future__ import annotations

import json
import math

from proto import admin_pb2
from router.admin.pdctl import as_dict, stats_text, table
from router.stats import RequestTrace, RouterStats, percentile, summarize


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99
    assert percentile(values, 100) == 100 and percentile(values, 0) == 1
    assert math.isnan(percentile([], 50))
    s = summarize([3.0, 1.0, 2.0])
    assert (s.count, s.mean, s.p50, s.p99) == (3, 2.0, 2.0, 3.0)


def test_a_trace_spreads_a_multi_token_message_over_its_tokens():
    t = RequestTrace(start=0.0)
    t.on_tokens(1, 0.5)  # first token: TTFT, no ITL yet
    t.on_tokens(0, 0.6)  # an empty message changes nothing
    t.on_tokens(2, 0.7)  # two tokens 200 ms after the last: two gaps of 100 ms
    t.on_tokens(1, 0.75)
    assert t.first_token == 0.5 and t.last_token == 0.75 and t.tokens == 4
    assert [round(x, 6) for x in t.itl_ms] == [100.0, 100.0, 50.0]


def test_router_stats_count_every_request_but_time_only_successes():
    s = RouterStats(window=2)
    ok = RequestTrace(start=0.0)
    ok.on_tokens(1, 0.1)
    ok.on_tokens(4, 0.5)
    s.routed("d0", "p0")
    s.finished(ok, 0.6, "OK", prompt_tokens=100, cached_tokens=64)
    s.routed("d1", None)
    s.finished(RequestTrace(start=0.0), 9.0, "DEADLINE_EXCEEDED")
    assert s.requests_by_status == {"OK": 1, "DEADLINE_EXCEEDED": 1}
    assert list(s.ttft_ms) == [100.0] and list(s.e2e_ms) == [600.0]
    assert [round(x, 6) for x in s.tpot_ms] == [100.0]  # 400 ms over 4 more tokens
    assert s.prefix_hit_rate == 0.64 and s.local_prefills == 1
    assert s.requests_by_decode_node == {"d0": 1, "d1": 1}
    for _ in range(3):  # the window keeps the last two
        s.finished(ok, 0.6, "OK")
    assert len(s.e2e_ms) == 2


def test_pdctl_json_keeps_numbers_and_marks_unset_costs():
    r = admin_pb2.ExplainRouteResponse(
        policy="cost",
        prompt_tokens=40,
        decode_node="d0",
        nodes=[
            admin_pb2.NodeScore(
                node_id="d0", role="decode", hit_blocks=2, cost=0.5, terms={"kv": 0.5}
            ),
            admin_pb2.NodeScore(node_id="d1", role="decode", excluded="drained by an operator"),
        ],
    )
    d = json.loads(json.dumps(as_dict(r)))
    assert d["prompt_tokens"] == 40 and d["prefill_node"] == "" and d["block_hashes"] == []
    assert d["nodes"][0] == {
        "node_id": "d0",
        "role": "decode",
        "hit_blocks": 2,
        "cost": 0.5,
        "excluded": "",
        "terms": {"kv": 0.5},
    }
    assert d["nodes"][1]["cost"] is None
    s = admin_pb2.StatsResponse(kv_transfer_bytes=2**40, prompt_tokens=10)
    assert as_dict(s)["kv_transfer_bytes"] == 2**40  # not the string proto JSON would give


def test_pdctl_tables_align_and_say_when_there_is_no_data():
    text = table(["NODE", "FREE"], [["decode-0", 5], ["d1", 1234]])
    assert text.splitlines() == ["NODE      FREE", "decode-0  5", "d1        1234"]
    out = stats_text(admin_pb2.StatsResponse(prompt_tokens=0))
    assert "ttft          0      -" in out and "prefix-cache hits: 0.0%" in out
