"""Request statistics this router saw: latency percentiles, prefix hits, placement.

Latencies are kept for the last ``window`` requests (or tokens, for ITL) so
that percentiles follow the current load; counters count since start. Each
router replica keeps its own; the nodes' counters (preemptions, KV transfer)
are cluster-wide and come from Redis. The same latencies also go into
cumulative histograms (seconds), which /metrics exports (common/metrics).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from common.metrics.histogram import (
    E2E_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    Histogram,
)


@dataclass(slots=True)
class Summary:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100])."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(values: deque[float] | list[float]) -> Summary:
    ordered = sorted(values)
    n = len(ordered)
    return Summary(
        count=n,
        mean=sum(ordered) / n if n else math.nan,
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p99=percentile(ordered, 99),
    )


@dataclass(slots=True)
class RequestTrace:
    """One request as the router relays it (times from time.monotonic())."""

    start: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    itl_ms: list[float] = field(default_factory=list)

    def on_tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            # A message with k tokens after a gap g: k gaps of g / k each.
            gap = (now - self.last_token) * 1e3 / n
            self.itl_ms.extend([gap] * n)
        self.last_token = now
        self.tokens += n


@dataclass
class RouterStats:
    window: int = 10_000
    ttft_ms: deque = field(init=False)
    tpot_ms: deque = field(init=False)
    itl_ms: deque = field(init=False)
    e2e_ms: deque = field(init=False)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests_by_status: Counter = field(default_factory=Counter)
    # Accepted requests with a structured output, by kind (json, regex, choice...).
    structured_by_kind: Counter = field(default_factory=Counter)
    requests_by_decode_node: Counter = field(default_factory=Counter)
    requests_by_prefill_node: Counter = field(default_factory=Counter)
    local_prefills: int = 0
    retries: int = 0  # attempts after a node failed before the first token
    # Streams moved after their first token (router/migration.py), by outcome:
    # started, completed, failed (after moving), refused (no migration left).
    migrations: Counter = field(default_factory=Counter)
    redis_errors: int = 0  # routing reads that failed
    stale_routes: int = 0  # decisions made on the last-known nodes (Redis unreachable)
    # Since start, successful requests only (as the windows above), in seconds.
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot_s: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    itl_s: Histogram = field(default_factory=lambda: Histogram(TOKEN_LATENCY_BUCKETS))
    e2e_s: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))

    def __post_init__(self) -> None:
        self.ttft_ms = deque(maxlen=self.window)
        self.tpot_ms = deque(maxlen=self.window)
        self.itl_ms = deque(maxlen=self.window)
        self.e2e_ms = deque(maxlen=self.window)

    def routed(self, decode_id: str, prefill_id: str | None) -> None:
        self.requests_by_decode_node[decode_id] += 1
        if prefill_id:
            self.requests_by_prefill_node[prefill_id] += 1
        else:
            self.local_prefills += 1

    def finished(
        self,
        trace: RequestTrace,
        end: float,
        status: str,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """Record a request that ended (``status``: a gRPC status code name)."""
        self.requests_by_status[status] += 1
        if status != "OK":
            return
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        e2e = end - trace.start
        self.e2e_ms.append(e2e * 1e3)
        self.e2e_s.observe(e2e)
        if trace.first_token is not None:
            ttft = trace.first_token - trace.start
            self.ttft_ms.append(ttft * 1e3)
            self.ttft_s.observe(ttft)
            if trace.tokens > 1 and trace.last_token is not None:
                tpot = (trace.last_token - trace.first_token) / (trace.tokens - 1)
                self.tpot_ms.append(tpot * 1e3)
                self.tpot_s.observe(tpot)
        self.itl_ms.extend(trace.itl_ms)
        self.itl_s.observe_many(ms / 1e3 for ms in trace.itl_ms)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
