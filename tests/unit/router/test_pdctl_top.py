"""`pdctl top --once` into a pipe or a file: every node on one line, whatever its
name's length (router/admin/top.py)."""

from __future__ import annotations

from types import SimpleNamespace

from proto import admin_pb2
from router.admin.top import cmd_top

NODE = "decode-10.20.30.40-50061"  # `pdserve up`-style ids on a real host are this long


class FakeAdmin:
    def ListNodes(self, request, **call):
        node = admin_pb2.NodeInfo(
            node_id=NODE, role="decode", kv_blocks_total=100, kv_blocks_free=25, running=3,
            heartbeat_age_ms=312, queued_prefill_tokens=123456,
            host_kv_blocks_total=400, host_kv_blocks_free=360,
        )  # fmt: skip
        no_tier = admin_pb2.NodeInfo(
            node_id="prefill-0", role="prefill", kv_blocks_total=100, kv_blocks_free=50,
        )  # fmt: skip
        return admin_pb2.ListNodesResponse(nodes=[node, no_tier])

    def Stats(self, request, **call):
        return admin_pb2.StatsResponse()


def test_once_into_a_pipe_keeps_each_row_whole(capsys):
    args = SimpleNamespace(call={}, once=True, interval=0.01, address="router.internal:50052")
    assert cmd_top(FakeAdmin(), args) == 0
    out = capsys.readouterr().out  # captured: not a terminal
    rows = [line for line in out.splitlines() if NODE in line]
    assert len(rows) == 1, out
    assert "75%" in rows[0] and "312 ms" in rows[0] and "123456" in rows[0]
    # Both tiers: the device pool's bar, then the host tier's (10% used).
    assert rows[0].index("75%") < rows[0].index("10%")
    header = next(line for line in out.splitlines() if "HOST USAGE" in line)
    assert header.index("KV USAGE") < header.index("HOST USAGE")
    (no_tier,) = [line for line in out.splitlines() if "prefill-0" in line]
    assert "50%" in no_tier and no_tier.split("50%")[1].split("│")[1].strip() == "-"
    assert all(line == line.rstrip() for line in out.splitlines())
    summary = next(line for line in out.splitlines() if line.startswith("pdctl top"))
    assert summary.endswith("q quits")
