"""The router checks requests against the context length its nodes registered,
also when the routing read that taught it came after the checks ran
(router/limits.py, router/service.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from common.cluster.state import NodeInfo, NodeRole
from engine.config import EngineConfig
from proto import pdserve_pb2
from router.frontend import Frontend
from router.inflight import InflightTracker
from router.models import BASE_MODEL
from router.policy import RoutingConfig
from router.service import RequestFailed, RouterServicer
from router.stats import RouterStats


@pytest.fixture(scope="module")
def frontend(demo_model_dir):
    return Frontend(EngineConfig.from_kwargs(str(demo_model_dir)))  # its own: the model's 8192


class FirstReadRouting:
    """Routing whose first read finds the nodes just registered with 512."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.config = RoutingConfig()
        self.stats = RouterStats()
        self.inflight = InflightTracker()
        self.routed = 0
        self.restarted = []  # hooks for a node that restarted (Routing.restarted)

    def start_view(self, hashes):
        return None

    async def model(self, name):
        return BASE_MODEL

    async def route(self, parsed, avoid, started):
        node = NodeInfo("d", NodeRole.DECODE, "h:1", self.frontend.model_id, 16, max_model_len=512)
        self.frontend.served.observe([node])
        self.routed += 1
        return SimpleNamespace(decision=None)  # relaying it would fail: never reached


def test_a_request_checked_before_the_nodes_length_was_known_is_checked_again(frontend):
    routing = FirstReadRouting(frontend)
    servicer = RouterServicer(frontend, routing, access_log=False)
    request = pdserve_pb2.GenerateRequest(
        token_ids=pdserve_pb2.TokenIds(ids=[7] * 500), sampling={"max_tokens": 100}
    )

    async def run():
        async for _ in servicer.generate(request, None):
            pass

    with pytest.raises(RequestFailed) as info:
        asyncio.run(run())
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "more than max_model_len 512" in info.value.details
    assert "at most 12 tokens" in info.value.details
    assert routing.stats.requests_by_status["INVALID_ARGUMENT"] == 1
