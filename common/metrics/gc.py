"""What a process exports about its garbage collector (``common.runtime.gc_heap.GcPauses``).

Every pdserve process that serves requests (nodes, router) exports these, so
a TTFT spike can be checked against a collector pause of the same process.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from common.metrics.families import gauge, histogram, labelled_counter

if TYPE_CHECKING:
    from common.runtime.gc_heap import GcPauses


class GcCollector(Collector):
    def __init__(self, pauses: GcPauses, labels: Mapping[str, str]) -> None:
        self.pauses = pauses
        self.labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        p, labels = self.pauses, self.labels
        yield histogram(
            "pdserve_gc_full_pause_seconds",
            "Pauses of the whole process by full (generation 2) garbage collections.",
            labels,
            p.full_pauses,
        )
        yield labelled_counter(
            "pdserve_gc_collections_total",
            "Garbage collections, by generation.",
            labels,
            "generation",
            {str(g): n for g, n in enumerate(p.collections)},
        )
        yield labelled_counter(
            "pdserve_gc_pause_seconds_total",
            "Seconds the process spent paused in garbage collections, by generation.",
            labels,
            "generation",
            {str(g): s for g, s in enumerate(p.seconds)},
        )
        yield gauge(
            "pdserve_gc_frozen_objects",
            "Objects frozen after start-up, which collections no longer walk.",
            labels,
            gc.get_freeze_count(),
        )
