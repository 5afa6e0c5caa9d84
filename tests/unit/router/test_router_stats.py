"""The router's request statistics and pdctl's output formats."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from proto import admin_pb2
from router.admin.pdctl import as_dict, cmd_explain, cmd_nodes, stats_text, table
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
        "host_hit_blocks": 0,
    }
    assert d["nodes"][1]["cost"] is None
    s = admin_pb2.StatsResponse(kv_transfer_bytes=2**40, prompt_tokens=10)
    assert as_dict(s)["kv_transfer_bytes"] == 2**40  # not the string proto JSON would give


def test_pdctl_tables_align_and_say_when_there_is_no_data():
    text = table(["NODE", "FREE"], [["decode-0", 5], ["d1", 1234]])
    assert text.splitlines() == ["NODE      FREE", "decode-0  5", "d1        1234"]
    out = stats_text(admin_pb2.StatsResponse(prompt_tokens=0))
    assert "ttft          0      -" in out and "prefix-cache hits: 0.0%" in out
    assert "speculative decoding: no proposals" in out


def test_pdctl_stats_shows_speculative_acceptance():
    s = admin_pb2.StatsResponse(spec_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=15)
    assert (
        "speculative decoding: 15 of 30 proposed tokens accepted (50.0%), "
        "mean acceptance length 2.50"
    ) in stats_text(s)
    assert as_dict(s)["spec_accepted_tokens"] == 15


class TieredAdmin:
    """Answers as a router whose nodes have a host tier would (proto messages)."""

    def ListNodes(self, request, **call):
        return admin_pb2.ListNodesResponse(
            nodes=[
                admin_pb2.NodeInfo(
                    node_id="p0", role="prefill", kv_blocks_total=100, kv_blocks_free=40,
                    cached_blocks=60, host_kv_blocks_total=800, host_kv_blocks_free=300,
                    host_cached_blocks=500,
                ),
                admin_pb2.NodeInfo(node_id="d0", role="decode", kv_blocks_total=90),
            ]
        )  # fmt: skip

    def ExplainRoute(self, request, **call):
        return admin_pb2.ExplainRouteResponse(
            policy="cost", prompt_tokens=640, decode_node="d0", prefill_node="p0",
            nodes=[
                admin_pb2.NodeScore(
                    node_id="p0", role="prefill", hit_blocks=12, host_hit_blocks=25, cost=72.0,
                    terms={"uncached": 48.0, "host_copy": 24.0, "queue": 0.0},
                ),
                admin_pb2.NodeScore(node_id="d0", role="decode", cost=0.1, terms={"kv": 0.1}),
            ],
        )  # fmt: skip


def _args(json_out: bool, **kw):
    return SimpleNamespace(call={}, json=json_out, **kw)


def test_pdctl_nodes_shows_both_tiers(capsys):
    assert cmd_nodes(TieredAdmin(), _args(False)) == 0
    header, p0, d0 = capsys.readouterr().out.splitlines()

    def column(row: str, name: str) -> str:  # cells start where their header does
        return row[header.index(name) :].split()[0]

    assert [column(p0, c) for c in ("KV FREE", "KV TOTAL", "HOST FREE", "HOST TOTAL")] == [
        "40", "100", "300", "800",
    ]  # fmt: skip
    assert (column(p0, "CACHED BLOCKS"), column(p0, "HOST CACHED")) == ("60", "500")
    assert (column(d0, "HOST TOTAL"), column(d0, "HOST CACHED")) == ("0", "0")
    assert cmd_nodes(TieredAdmin(), _args(True)) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["host_kv_blocks_total"] == 800 and rows[0]["host_kv_blocks_free"] == 300
    assert rows[0]["host_cached_blocks"] == 500 and rows[0]["cached_blocks"] == 60
    assert rows[1]["host_kv_blocks_total"] == 0


def test_pdctl_explain_shows_each_tiers_hit(capsys):
    args = _args(False, prompt="hi", token_ids=False, chat=False, cache_salt="", model="")
    assert cmd_explain(TieredAdmin(), args) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("NODE"))
    p0 = next(line for line in lines if line.startswith("p0"))
    assert header.index("HIT BLOCKS") == p0.index("12")
    assert header.index("HOST HIT") == p0.index("25")
    assert "host_copy=24" in p0
    args.json = True
    assert cmd_explain(TieredAdmin(), args) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert (nodes[0]["hit_blocks"], nodes[0]["host_hit_blocks"]) == (12, 25)


def test_list_nodes_carries_both_tiers_from_the_registry():
    from common.cluster.state import NodeInfo, NodeRole
    from router.admin.service import node_to_proto

    info = NodeInfo(
        node_id="p0", role=NodeRole.PREFILL, address="a:1", model_id="m", block_size=16,
        kv_blocks_total=100, kv_blocks_free=40, host_kv_blocks_total=800,
        host_kv_blocks_free=300, seen_ms=1_000,
    )  # fmt: skip
    n = node_to_proto(info, (60, 500), server_now_ms=1_250)
    assert (n.kv_blocks_total, n.kv_blocks_free, n.cached_blocks) == (100, 40, 60)
    assert (n.host_kv_blocks_total, n.host_kv_blocks_free, n.host_cached_blocks) == (800, 300, 500)
    assert n.heartbeat_age_ms == 250
