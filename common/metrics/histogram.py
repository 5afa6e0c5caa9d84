"""A cumulative histogram cheap enough to observe every token, and the buckets we use.

prometheus-client's ``Histogram.observe`` takes one value per call, each call
some Python (docs/metrics.md, "Histogram buckets"); the router observes one
inter-token latency per generated token, so a long reply would cost milliseconds
of event-loop time. This one takes a batch (one sort, a bisect per bucket, one
lock) and knows nothing about Prometheus: the stats objects that own it stay
importable without prometheus-client, and the collectors in this package turn it
into a ``HistogramMetricFamily`` at scrape time.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Latencies in seconds. TTFT spans a cached short prompt on an idle GPU
# (milliseconds) to a long prompt queued behind others on a CPU (tens of s).
TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# A decode step is a few ms on a GPU, tens to hundreds on a CPU.
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
    30.0, 45.0, 60.0, 120.0, 240.0, 480.0, 960.0,
)  # fmt: skip
# The device's wait for an engine step's host work: zero (a few microseconds
# of event resolution) while the host keeps ahead, milliseconds when it is late.
STEP_IDLE_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5,
)  # fmt: skip
# Tokens in one engine step: a few decodes to a full chunked-prefill budget.
STEP_TOKEN_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
)  # fmt: skip
# One request's KV push: a few blocks over NVLink (sub-ms) to a long prompt
# over gloo on a busy CPU (seconds); the transfer timeout is 30 s.
KV_TRANSFER_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Bytes per second of one transfer: gloo on loopback to NCCL over NVLink, some
# three orders of magnitude apart (docs/metrics.md, "Histogram buckets").
KV_BANDWIDTH_BUCKETS = (
    1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10,
    1e11, 2e11, 3e11, 5e11, 1e12,
)  # fmt: skip


@dataclass(slots=True)
class HistogramSnapshot:
    """Cumulative counts per upper bound (the last bound is +Inf), the count and the sum."""

    buckets: list[tuple[float, int]]
    count: int
    sum: float


@dataclass(slots=True)
class Histogram:
    """Counts per bucket since start. Observed on one thread, read by the scrape's."""

    bounds: Sequence[float]
    _counts: list[int] = field(init=False)
    _sum: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        bounds = tuple(float(b) for b in self.bounds)
        if not bounds or list(bounds) != sorted(set(bounds)) or math.isinf(bounds[-1]):
            raise ValueError(f"histogram bounds must be finite and strictly increasing: {bounds}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one is +Inf

    def observe(self, value: float, count: int = 1) -> None:
        """Record ``value`` ``count`` times (Prometheus buckets are ``le``: inclusive)."""
        i = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def observe_many(self, values: Iterable[float]) -> None:
        """Record each of ``values``: one sort (C) and a bisect per bucket, not per value."""
        ordered = sorted(values)
        if not ordered:
            return
        hits, below = [], 0
        for bound in self.bounds:
            upto = bisect.bisect_right(ordered, bound)  # values <= bound
            hits.append(upto - below)
            below = upto
        hits.append(len(ordered) - below)
        total = math.fsum(ordered)
        with self._lock:
            for i, n in enumerate(hits):
                if n:
                    self._counts[i] += n
            self._sum += total

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return HistogramSnapshot(cumulative, running, total)

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)
