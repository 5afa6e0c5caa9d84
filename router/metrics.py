"""What a router exports: client-facing latencies, requests by final status, placement.

Read at scrape time from the router's ``RouterStats`` (which keeps the
histograms beside the windows that ``pdctl stats`` reports percentiles of) and
its in-flight tracker; nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics.families import counter, gauge, histogram, labelled_counter
from engine.sampling_params import STRUCTURED_KINDS

if TYPE_CHECKING:
    from router.routing import Routing

# Exported at 0 before they first happen, so that rate() sees the first one.
STATUSES = (
    "OK",
    "INVALID_ARGUMENT",
    "UNAVAILABLE",
    "RESOURCE_EXHAUSTED",
    "DEADLINE_EXCEEDED",
    "CANCELLED",
    "INTERNAL",
)

NO_LABELS: dict[str, str] = {}


class RouterCollector(Collector):
    def __init__(self, routing: Routing) -> None:
        self.routing = routing

    def collect(self) -> Iterator[Metric]:
        stats = self.routing.stats
        yield from self._requests(stats)
        yield from self._placement(stats)
        yield from self._reliability(stats)

    def _requests(self, stats) -> Iterator[Metric]:
        """What the requests were: their ends, latencies and prompt tokens."""
        by_status = dict.fromkeys(STATUSES, 0) | dict(stats.requests_by_status)
        yield labelled_counter(
            "pdserve_router_requests_total",
            "Requests that ended, by final gRPC status (CANCELLED: the client went away).",
            NO_LABELS,
            "status",
            by_status,
        )
        yield labelled_counter(
            "pdserve_router_structured_requests_total",
            "Requests accepted with a structured output (JSON schema, regex, choice, grammar, "
            "JSON object, structural tag; tool_choice required or named is a JSON schema), by kind.",
            NO_LABELS,
            "kind",
            dict.fromkeys(STRUCTURED_KINDS, 0) | dict(stats.structured_by_kind),
        )
        yield gauge(
            "pdserve_router_requests_in_flight",
            "Streams this router is relaying now.",
            NO_LABELS,
            self.routing.inflight.in_flight,
        )
        for name, doc, hist in (
            (
                "pdserve_router_time_to_first_token_seconds",
                "Time to first token as the router saw it (request in to first token out).",
                stats.ttft_s,
            ),
            (
                "pdserve_router_time_per_output_token_seconds",
                "Per request: (last token - first token) / (tokens - 1).",
                stats.tpot_s,
            ),
            (
                "pdserve_router_inter_token_latency_seconds",
                "Per token after the first: gap since the previous message over its token count.",
                stats.itl_s,
            ),
            (
                "pdserve_router_e2e_request_latency_seconds",
                "Request in to stream end.",
                stats.e2e_s,
            ),
        ):
            yield histogram(name, doc + " Successful requests only.", NO_LABELS, hist)
        yield counter(
            "pdserve_router_prompt_tokens_total",
            "Prompt tokens of successful requests.",
            NO_LABELS,
            stats.prompt_tokens,
        )
        yield counter(
            "pdserve_router_cached_prompt_tokens_total",
            "Prompt tokens of successful requests served from a prefix cache (either node).",
            NO_LABELS,
            stats.cached_tokens,
        )

    def _placement(self, stats) -> Iterator[Metric]:
        """Where the requests went."""
        routed = CounterMetricFamily(
            "pdserve_router_routed_requests_total",
            "Requests sent to each node, by the role it played.",
            labels=["role", "node"],
        )
        for role, counts in (
            ("decode", stats.requests_by_decode_node),
            ("prefill", stats.requests_by_prefill_node),
        ):
            for node, n in dict(counts).items():
                routed.add_metric([role, node], n)
        yield routed
        yield counter(
            "pdserve_router_local_prefills_total",
            "Requests the decode node prefilled itself (no prefill node named).",
            NO_LABELS,
            stats.local_prefills,
        )

    def _reliability(self, stats) -> Iterator[Metric]:
        """What failed, and what the router did about it."""
        yield counter(
            "pdserve_router_retries_total",
            "Extra attempts after a node failed a request before its first token.",
            NO_LABELS,
            stats.retries,
        )
        yield labelled_counter(
            "pdserve_router_migrations_total",
            "Streams moved to another decode node after their first token, by outcome.",
            NO_LABELS,
            "outcome",
            {o: stats.migrations[o] for o in ("started", "completed", "failed", "refused")},
        )
        yield counter(
            "pdserve_router_stale_routes_total",
            "Routing decisions made on the last-known nodes while Redis was unreachable.",
            NO_LABELS,
            stats.stale_routes,
        )
        yield labelled_counter(
            "pdserve_redis_errors_total",
            "Redis operations that failed, by operation.",
            NO_LABELS,
            "op",
            {"route": stats.redis_errors},
        )
