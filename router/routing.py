"""The router's routing state: one Redis read, the policy, and what is in flight.

Shared by the public service (which routes and relays) and the Admin service
(which explains a route without taking it), so an explanation is computed
exactly the way a real decision is.

Restarts: a node that comes back under the same id (a supervisor's restart,
same address) registers a new ``started_ms``. The first read that shows it
forgets what the old process did: its failure cool-down, a failed request's
wish to avoid it, and (through ``restarted``) the router's connections to its
address, whose reconnect backoff would otherwise refuse the first requests
for seconds. A node is routable from its first heartbeat on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from common.cluster.redis_script import Sent
from common.cluster.state import Cluster, ClusterView, NodeInfo, RouteCandidate
from router.frontend import ParsedRequest
from router.inflight import InflightTracker
from router.limits import ServedLength
from router.models import ModelChoice, resolve_model, served_adapters
from router.numerics import NO_HASHES, PromptHashes, ServedNumerics
from router.policy import (
    LocalLoad,
    NoRoute,
    RouteDecision,
    RouteRequest,
    RoutingConfig,
    choose_route,
)
from router.stats import RouterStats

logger = logging.getLogger(__name__)

_NONE: Mapping[str, int] = {}  # route()'s default: avoid nothing


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
        served: ServedLength | None = None,
        numerics: ServedNumerics | None = None,
    ) -> None:
        self.cluster = cluster
        # Learns the nodes' context length from every read (router/limits.py).
        self.served = served
        # Learns the nodes' numerics classes from every read (router/numerics.py).
        self.numerics = numerics or ServedNumerics(model_id)
        self.model_id = model_id
        self.block_size = block_size
        self.config = config or RoutingConfig()
        self.remote_prefill = remote_prefill
        self.rng = rng or random.Random()
        self.inflight = InflightTracker()
        self.stats = RouterStats()
        self._turns = itertools.count()
        # The last view Redis gave, for routing while it is unreachable.
        self._last_view: ClusterView | None = None
        self._probe: asyncio.Task | None = None
        # Each node's started_ms as last read; a new one is a new process.
        self._started: dict[str, int] = {}
        # Called with a node that restarted (module docstring), on the loop's thread.
        self.restarted: list[Callable[[NodeInfo], None]] = []
        # LoRA adapters of the live nodes as last read, name -> digest (router/models.py).
        self.adapters: dict[str, str] = {}

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
            model=parsed.model,
        )

    async def model(self, name: str) -> ModelChoice:
        """The model a request names (ModelNotFound if none). An adapter the
        last read did not show is looked for with a fresh read first: it may
        have been registered since (or no request has read the registry yet)."""
        if name and name != self.model_id and name not in self.adapters:
            await self.read_nodes()
        return resolve_model(name, self.model_id, self.adapters)

    def start_view(self, block_hashes: PromptHashes) -> Sent | None:
        """The routing read of these hashes, written now where it can be (Redis up,
        the routing connection open), so that the caller's work overlaps its
        round trip: give it to ``route``. None: ``route`` reads as usual."""
        if self.redis_down:
            return None
        try:
            return self.cluster.start_view(*block_hashes.route_args(self.numerics.tags))
        except Exception:  # whatever failed fails again in route, which handles it
            return None

    async def route(
        self, parsed: ParsedRequest, avoid: Mapping[str, int] = _NONE, started: Sent | None = None
    ) -> Routed:
        """Decide (one Redis round trip); raises NoRoute saying why there is none.

        ``avoid``: nodes that already failed this request (it is being
        retried), each with the ``started_ms`` of the process that failed (0:
        unknown); a new process under that id is not avoided.
        ``started``: ``start_view(parsed.block_hashes)``'s read, if there is one.
        """
        view = await self.view(parsed.block_hashes, started)
        request = self.route_request(parsed)
        loads = self.inflight.loads(view)
        for node_id, process in avoid.items():
            if process and self._started.get(node_id, process) != process:
                continue  # it restarted since it failed this request
            loads.setdefault(node_id, LocalLoad()).failed_ago_s = 0.0
        decision = choose_route(view, request, self.config, loads, self.rng, next(self._turns))
        return Routed(decision, view, request)

    @property
    def redis_down(self) -> bool:
        return self._probe is not None and not self._probe.done()

    async def view(
        self, block_hashes: PromptHashes = NO_HASHES, started: Sent | None = None
    ) -> ClusterView:
        """Redis's view, or while Redis is unreachable the last-known nodes
        (with no prefix hits: those are unknown) and a background probe. Each
        node's hit is searched with its own numerics class's hashes."""
        if not self.redis_down:
            try:
                if started is not None:
                    view = await self.cluster.finish_view(started)
                else:
                    args = block_hashes.route_args(self.numerics.tags)
                    view = await self.cluster.view(*args)
            except Exception as e:  # down, refusing, timing out: never hang a request on it
                self.stats.redis_errors += 1
                if self._last_view is None:
                    raise NoRoute(f"cluster state is unavailable: {e}") from e
                logger.warning(
                    "Redis unreachable (%s); routing on the %d last-known nodes",
                    e,
                    len(self._last_view.candidates),
                )
                self._probe = asyncio.create_task(self._probe_until_up())
            else:
                self._last_view = view
                self.adapters = served_adapters((c.node for c in view.candidates), self.model_id)
                if self.served is not None:
                    self.served.observe(c.node for c in view.candidates)
                self.numerics.observe(c.node for c in view.candidates)
                self._notice_restarts(view)
                return view
        self.stats.stale_routes += 1
        last = self._last_view
        return ClusterView(
            last.now_ms, [RouteCandidate(c.node, 0, c.drained) for c in last.candidates]
        )

    async def read_nodes(self) -> None:
        """One read of the live nodes where no request makes one (start-up,
        ``/v1/models``), for what they registered (router/limits.py)."""
        with contextlib.suppress(NoRoute):
            await self.view()

    def _notice_restarts(self, view: ClusterView) -> None:
        """Forget what a restarted node's old process did (module docstring)."""
        known = self._started
        for c in view.candidates:
            node = c.node
            before = known.get(node.node_id)
            if before == node.started_ms:
                continue
            known[node.node_id] = node.started_ms
            if before is None or not node.started_ms:
                continue  # first seen, or a node that does not say
            logger.info("node %s restarted (a new process at %s)", node.node_id, node.address)
            self.inflight.succeeded(node.node_id)
            for hook in self.restarted:
                hook(node)

    async def _probe_until_up(self) -> None:
        while True:
            await asyncio.sleep(self.config.redis_retry_s)
            start = time.monotonic()
            try:
                self._last_view = await self.cluster.view([])
            except Exception:
                self.stats.redis_errors += 1
                continue
            logger.info(
                "Redis reachable again (%.0f ms); routing on live state",
                (time.monotonic() - start) * 1e3,
            )
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe

    def dispatch(self, routed: Routed):
        """Count the request as in flight on its nodes (until ``inflight.finish``)."""
        d, req = routed.decision, routed.request
        # A host-tier hit is copied in, not computed: no prefill work.
        if d.prefill:
            hit = d.prefill_hit_blocks + d.prefill_host_hit_blocks
        else:
            hit = d.decode_hit_blocks + d.decode_host_hit_blocks
        uncached = max(0, req.prompt_tokens - hit * self.block_size)
        blocks = -(-req.prompt_tokens // self.block_size) + 1
        self.stats.routed(d.decode.node_id, d.prefill.node_id if d.prefill else None)
        return self.inflight.start(
            d.decode.node_id, d.prefill.node_id if d.prefill else None, uncached, blocks
        )
