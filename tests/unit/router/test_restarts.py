"""A node that restarts under its id is routable at once, and a migrated
stream waits (a bounded time) for a decode node to come back (issue 50, item 6).

The cluster here is a stand-in that returns the views a test sets; the
routing, its failure cool-down and the migration wait are the router's own.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from common.cluster.state import ClusterView, NodeInfo, NodeRole, RouteCandidate
from router.migration import continuation_route
from router.models import BASE_MODEL
from router.numerics import NO_HASHES
from router.policy import NoRoute, RoutingConfig
from router.routing import Routing


class Views:
    """The cluster as Redis would show it: ``nodes`` read on every view."""

    def __init__(self) -> None:
        self.nodes: list[NodeInfo] = []
        self.now_ms = 1_000_000

    def start_view(self, block_hashes):
        return None

    async def view(self, block_hashes, numerics=()) -> ClusterView:
        self.now_ms += 10
        for n in self.nodes:
            n.seen_ms = self.now_ms  # a fresh heartbeat
        return ClusterView(self.now_ms, [RouteCandidate(n, 0) for n in self.nodes])


def decode(started_ms: int) -> NodeInfo:
    return NodeInfo(
        node_id="decode-0",
        role=NodeRole.DECODE,
        address="127.0.0.1:50071",
        model_id="m",
        block_size=16,
        kv_blocks_total=100,
        kv_blocks_free=100,
        started_ms=started_ms,
    )


PARSED = SimpleNamespace(
    params=SimpleNamespace(n=1, prompt_logprobs=None),
    prompt_token_ids=[1] * 40,
    block_hashes=NO_HASHES,
    model=BASE_MODEL,
)


def routing(views: Views, **config) -> Routing:
    return Routing(views, "m", 16, RoutingConfig(**config))


def run(coro):
    return asyncio.run(coro)


def test_a_restarted_node_is_routable_at_once_and_its_connections_are_dropped():
    views = Views()
    views.nodes = [decode(started_ms=1)]
    r = routing(views, failure_cooldown_s=60)
    restarted: list[str] = []
    r.restarted.append(lambda node: restarted.append(node.address))

    async def go():
        assert (await r.route(PARSED)).decision.decode.node_id == "decode-0"
        r.inflight.failed("decode-0")  # a refused call: cool-down for everyone
        with pytest.raises(NoRoute, match="a call to it failed"):
            await r.route(PARSED)
        # The same id registers again from a new process.
        views.nodes = [decode(started_ms=2)]
        routed = await r.route(PARSED)
        assert routed.decision.decode.started_ms == 2
        assert restarted == ["127.0.0.1:50071"]  # once, on the first read that showed it
        await r.route(PARSED)
        assert restarted == ["127.0.0.1:50071"]

    run(go())


def test_a_failed_request_avoids_the_process_that_failed_it_not_its_successor():
    views = Views()
    views.nodes = [decode(started_ms=1)]
    r = routing(views)

    async def go():
        await r.route(PARSED)
        with pytest.raises(NoRoute):
            await r.route(PARSED, avoid={"decode-0": 1})
        views.nodes = [decode(started_ms=2)]
        assert (await r.route(PARSED, avoid={"decode-0": 1})).decision.decode.started_ms == 2
        with pytest.raises(NoRoute):  # 0: which process failed is unknown: avoided
            await r.route(PARSED, avoid={"decode-0": 0})

    run(go())


def test_a_migrated_stream_waits_for_a_decode_node_then_fails_after_the_bound():
    views = Views()
    views.nodes = [decode(started_ms=1)]
    r = routing(views, migration_wait_s=1.0)

    async def go():
        await r.route(PARSED)
        views.nodes = []  # the only decode node died; its entry expired
        asyncio.get_running_loop().call_later(0.4, lambda: views.nodes.append(decode(2)))
        start = time.monotonic()
        routed = await continuation_route(r, PARSED, {"decode-0": 1}, "r", None)
        assert routed.decision.decode.started_ms == 2 and time.monotonic() - start < 1.0
        views.nodes = []
        start = time.monotonic()
        with pytest.raises(NoRoute, match="--migration-wait"):
            await continuation_route(r, PARSED, {"decode-0": 2}, "r", None)
        assert 1.0 <= time.monotonic() - start < 2.0
        # Never past the client's deadline.
        start = time.monotonic()
        with pytest.raises(NoRoute):
            await continuation_route(r, PARSED, {"decode-0": 2}, "r", time.monotonic() + 0.3)
        assert time.monotonic() - start < 0.9

    run(go())
