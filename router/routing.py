"""The router's routing state: one Redis read, the policy, and what is in flight.

Shared by the public service (which routes and relays) and the Admin service
(which explains a route without taking it), so an explanation is computed
exactly the way a real decision is.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from common.cluster import Cluster, ClusterView
from router.frontend import ParsedRequest
from router.inflight import InflightTracker
from router.policy import NoRoute, RouteDecision, RouteRequest, RoutingConfig, choose_route
from router.stats import RouterStats


@dataclass(slots=True)
class Routed:
    decision: RouteDecision
    view: ClusterView
    request: RouteRequest


class Routing:
    def __init__(
        self,
        cluster: Cluster,
        model_id: str,
        block_size: int,
        config: RoutingConfig | None = None,
        remote_prefill: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self.cluster = cluster
        self.model_id = model_id
        self.block_size = block_size
        self.config = config or RoutingConfig()
        self.remote_prefill = remote_prefill
        self.rng = rng or random.Random()
        self.inflight = InflightTracker()
        self.stats = RouterStats()
        self._turns = itertools.count()

    def route_request(self, parsed: ParsedRequest) -> RouteRequest:
        params = parsed.params
        return RouteRequest(
            model_id=self.model_id,
            block_size=self.block_size,
            prompt_tokens=len(parsed.prompt_token_ids),
            # n > 1 and prompt logprobs need the whole prefill where the decode runs.
            allow_remote_prefill=(
                self.remote_prefill and params.n == 1 and params.prompt_logprobs is None
            ),
        )

    async def route(self, parsed: ParsedRequest) -> Routed:
        """Decide (one Redis round trip); raises NoRoute saying why there is none."""
        try:
            view = await self.cluster.view(parsed.block_hashes)
        except Exception as e:  # Redis down or refusing: say so, do not hang
            self.stats.redis_errors += 1
            raise NoRoute(f"cluster state is unavailable: {e}") from e
        request = self.route_request(parsed)
        decision = choose_route(
            view,
            request,
            self.config,
            self.inflight.loads(view),
            self.rng,
            next(self._turns),
        )
        return Routed(decision, view, request)

    def dispatch(self, routed: Routed):
        """Count the request as in flight on its nodes (until ``inflight.finish``)."""
        d, req = routed.decision, routed.request
        hit = d.prefill_hit_blocks if d.prefill else d.decode_hit_blocks
        uncached = max(0, req.prompt_tokens - hit * self.block_size)
        blocks = -(-req.prompt_tokens // self.block_size) + 1
        self.stats.routed(d.decode.node_id, d.prefill.node_id if d.prefill else None)
        return self.inflight.start(
            d.decode.node_id, d.prefill.node_id if d.prefill else None, uncached, blocks
        )
