"""What a prefill or decode node exports: engine load, KV blocks, KV transfers, Redis.

Everything is read at scrape time from state the node already keeps, never by
calling into the engine thread (a scrape must not wait for an engine step, and
must not slow one down):

- ``EngineThread.stats``: the ``EngineStats`` snapshot the engine thread
  publishes after every step and every batch of commands (one reference read);
- the worker's ``counters()`` (the same numbers the heartbeat publishes to
  Redis, so Redis, pdctl and Prometheus agree) and ``histograms()``;
- the heartbeat's own counts (Redis round trips that worked or failed).

Every series carries ``role`` (prefill / decode) and ``node`` (the node id in
Redis and pdctl) so dashboards need no relabelling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from common.metrics.families import (
    counter,
    gauge,
    histogram,
    labelled_counter,
    labelled_histogram,
)
from common.metrics.histogram import Histogram
from common.metrics.steps import StepHistograms
from common.runtime.reliability import Stage

ABORT_STAGES = tuple(stage.value for stage in Stage)

if TYPE_CHECKING:
    from common.cluster.state import NodeInfo
    from common.runtime.heartbeat import Heartbeat
    from engine.engine_thread import EngineThread
    from engine.spec_decode.speculator import SpecDecodeStats

# Worker counters (NodeInfo field names, as ``counters()`` returns them) -> metric.
# None: deliberately not exported (named with the reason).
COUNTERS: dict[str, tuple[str, str] | None] = {
    "requests_total": (
        "pdserve_node_requests_total",
        "Requests this node accepted (decode: Decode calls; prefill: Prefill calls).",
    ),
    "kv_transfers": (
        "pdserve_kv_transfers_total",
        "KV transfers sent (prefill) or landed in a reservation (decode).",
    ),
    "kv_transfer_bytes": (
        "pdserve_kv_transfer_bytes_total",
        "KV payload bytes sent (prefill) or received into reservations (decode).",
    ),
    "kv_transfer_failures": (
        "pdserve_kv_transfer_failures_total",
        "KV transfers that failed (send error or timeout; on decode, reservations failed "
        "by a broken channel).",
    ),
    "kv_late_transfers": (
        "pdserve_kv_late_transfers_total",
        "KV segments (per prefill step) that arrived, wholly or partly, for a reservation "
        "already gone and were dropped (decode).",
    ),
    "kv_checksum_mismatches": (
        "pdserve_kv_checksum_mismatches_total",
        "Landed KV that differed from what the prefill node sent (decode, --verify-kv).",
    ),
    # The sum of pdserve_kv_transfer_duration_seconds already is this.
    "kv_transfer_us": None,
    "deadline_exceeded": (
        "pdserve_deadline_exceeded_total",
        "Requests aborted on this node because the client's deadline passed.",
    ),
    "leases_expired": (
        "pdserve_kv_leases_expired_total",
        "KV reservations reclaimed unfilled at the end of their lease (decode).",
    ),
    "kv_gathers_copy_engine": (
        "pdserve_kv_gathers_copy_engine_total",
        "KV chunks gathered out of the cache by the GPU's copy engines, not by a kernel "
        "beside the forward (prefill; rank 0 of a tensor-parallel node).",
    ),
    "rejected": (
        "pdserve_requests_rejected_total",
        "Requests refused for lack of room: queue full, no KV blocks or slots "
        "(RESOURCE_EXHAUSTED).",
    ),
    # Exported together as pdserve_requests_aborted_total{stage}.
    **{f"aborted_{stage}": None for stage in ABORT_STAGES},
}

# Worker histograms (``histograms()`` keys) -> metric.
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "kv_transfer_seconds": (
        "pdserve_kv_transfer_duration_seconds",
        "Per KV transfer sent: seconds its chunks spent on the wire, summed.",
    ),
    "kv_transfer_bandwidth": (
        "pdserve_kv_transfer_bandwidth_bytes_per_second",
        "Per KV transfer sent: bytes over the seconds its chunks spent on the wire.",
    ),
    "request_queue_seconds": (
        "pdserve_request_queue_time_seconds",
        "Per prompt computed on this node: received by the engine to first admitted into a batch.",
    ),
    "request_prefill_seconds": (
        "pdserve_request_prefill_time_seconds",
        "Per prompt computed on this node: first admitted into a batch to its first token sampled.",
    ),
}


class NodeCollector(Collector):
    def __init__(
        self,
        info: NodeInfo,
        engine: EngineThread,
        heartbeat: Heartbeat | None = None,
        counters: Callable[[], dict[str, int]] | None = None,
        histograms: Callable[[], dict[str, Histogram]] | None = None,
        steps: StepHistograms | None = None,
    ) -> None:
        self.info = info
        self.engine = engine
        self.heartbeat = heartbeat
        self.counters = counters
        self.histograms = histograms
        self.steps = steps
        self.labels = {"role": info.role.value, "node": info.node_id}

    def collect(self) -> Iterator[Metric]:
        labels, info = self.labels, self.info
        yield gauge(
            "pdserve_node_info",
            "Always 1; the node's model and block size as labels.",
            labels | {"model": info.model_id, "block_size": str(info.block_size)},
            1,
        )
        yield gauge(
            "pdserve_node_draining",
            "1 while the node shuts down (SIGTERM) and finishes what it owes.",
            labels,
            int(info.draining),
        )
        yield gauge(
            "pdserve_engine_alive",
            "1 while the engine thread runs; 0 after a failed step (the node serves nothing).",
            labels,
            int(self.engine.alive),
        )
        yield from self._engine(labels)
        yield from self._host_tier(labels)
        stats = self.engine.stats
        yield gauge(
            "pdserve_offloaded_weight_bytes",
            "Weight bytes kept in host memory and copied in per layer (--cpu-offload-gb).",
            labels,
            stats.offloaded_weight_bytes,
        )
        if stats.spec_decode is not None:
            yield from _spec_decode(labels, stats.spec_decode)
        yield from _grammar(labels, stats.grammar)
        yield from self._counters(labels)
        yield from self._histograms(labels)
        yield from self._heartbeat(labels)

    def _host_tier(self, labels: dict[str, str]) -> Iterator[Metric]:
        """The KV blocks' host tier (``--swap-space``; all 0 without one)."""
        s = self.engine.stats
        yield gauge(
            "pdserve_host_kv_blocks_capacity",
            "KV block slots in the host tier behind the KV pool (0: no host tier).",
            labels,
            s.num_host_kv_blocks,
        )
        yield gauge(
            "pdserve_host_kv_blocks_free",
            "Host-tier slots a spill or swap can take (empty, or cached and evictable).",
            labels,
            s.num_free_host_kv_blocks,
        )
        yield counter(
            "pdserve_host_tier_hit_blocks_total",
            "Prefix blocks served from the host tier (copied back, not recomputed).",
            labels,
            s.host_tier_hit_blocks,
        )
        yield labelled_counter(
            "pdserve_kv_tier_copied_blocks_total",
            "KV blocks copied between the pool and the host tier, by direction.",
            labels,
            "direction",
            {"to_host": s.num_blocks_copied_to_host, "to_device": s.num_blocks_copied_to_device},
        )
        yield labelled_counter(
            "pdserve_kv_tier_copied_bytes_total",
            "KV bytes copied between the pool and the host tier, by direction.",
            labels,
            "direction",
            {"to_host": s.bytes_copied_to_host, "to_device": s.bytes_copied_to_device},
        )
        yield counter(
            "pdserve_kv_tier_copy_in_seconds_total",
            "Seconds the copies to the device spent on the bus (rank 0's; timed on the "
            "copy stream): the to_device bytes over these are the tier's copy-in rate.",
            labels,
            s.seconds_copying_to_device,
        )
        yield counter(
            "pdserve_swap_preemptions_total",
            "Sequences preempted by swap (blocks to the host tier and back).",
            labels,
            s.num_swap_preemptions,
        )
        yield counter(
            "pdserve_swap_fallbacks_total",
            "Preemptions by swap that fell back to recompute (the host tier was full).",
            labels,
            s.num_swap_fallbacks,
        )

    def _counters(self, labels: dict[str, str]) -> Iterator[Metric]:
        if self.counters is not None:
            values = self.counters()
            for key, value in values.items():
                spec = COUNTERS.get(key)
                if spec is not None:
                    yield counter(spec[0], spec[1], labels, value)
            stages = {s: values[f"aborted_{s}"] for s in ABORT_STAGES if f"aborted_{s}" in values}
            if stages:
                yield labelled_counter(
                    "pdserve_requests_aborted_total",
                    "Requests aborted on this node (client gone, deadline, peer failure, "
                    "lease), by the stage they were in.",
                    labels,
                    "stage",
                    stages,
                )

    def _histograms(self, labels: dict[str, str]) -> Iterator[Metric]:
        if self.histograms is not None:
            for key, hist in self.histograms().items():
                name, doc = HISTOGRAMS[key]
                yield histogram(name, doc, labels, hist)
        if self.steps is not None:
            yield histogram(
                "pdserve_engine_step_tokens",
                "Per engine step: tokens it ran (prompt chunks and decodes).",
                labels,
                self.steps.tokens,
            )
            yield labelled_histogram(
                "pdserve_engine_idle_before_step_seconds",
                "Per engine step queued behind another (CUDA): seconds the device sat idle "
                "between that step's end and this one's first work, waiting for the host; "
                "by step kind (prompt: with prompt rows; decode: decodes only).",
                labels,
                "step",
                self.steps.idle_by_step_kind(),
            )

    def _heartbeat(self, labels: dict[str, str]) -> Iterator[Metric]:
        if self.heartbeat is not None:
            hb = self.heartbeat
            yield counter(
                "pdserve_heartbeats_total",
                "Heartbeats published to Redis (load, counters and cache events).",
                labels,
                hb.published,
            )
            yield gauge(
                "pdserve_heartbeat_consecutive_failures",
                "Heartbeats that failed in a row (0 once Redis answers again).",
                labels,
                hb.consecutive_failures,
            )
            yield labelled_counter(
                "pdserve_redis_errors_total",
                "Redis operations that failed, by operation.",
                labels,
                "op",
                {"heartbeat": hb.failures},
            )

    def _engine(self, labels: dict[str, str]) -> Iterator[Metric]:
        s = self.engine.stats  # the engine thread swaps in a new snapshot; never mutated
        yield gauge(
            "pdserve_requests_running", "Sequences in the running batch.", labels, s.num_running
        )
        yield gauge(
            "pdserve_requests_waiting",
            "Sequences queued for admission (the node's queue depth).",
            labels,
            s.num_waiting,
        )
        yield gauge(
            "pdserve_requests_reserved",
            "Requests holding KV blocks while their prompt's KV is on its way (decode).",
            labels,
            s.num_reserved,
        )
        yield gauge(
            "pdserve_queued_prefill_tokens",
            "Prompt tokens admitted or waiting but not yet computed.",
            labels,
            s.num_queued_prefill_tokens,
        )
        yield gauge(
            "pdserve_kv_blocks_capacity",
            "KV blocks in the pool (free + cached + used).",
            labels,
            s.num_kv_blocks,
        )
        # num_free_kv_blocks counts both free kinds (it is what an allocation can take).
        family = gauge(
            "pdserve_kv_blocks",
            "KV blocks by state: free (no cached content), cached (free, keeps a "
            "prefix-cache hash, evictable), used (held by a request).",
            labels | {"state": "free"},
            s.num_free_kv_blocks - s.num_cached_free_kv_blocks,
        )
        family.add_metric([*labels.values(), "cached"], s.num_cached_free_kv_blocks)
        family.add_metric([*labels.values(), "used"], s.num_kv_blocks - s.num_free_kv_blocks)
        yield family
        yield counter(
            "pdserve_preemptions_total",
            "Sequences preempted (by recompute or swap) for lack of KV blocks.",
            labels,
            s.num_preemptions,
        )
        yield counter(
            "pdserve_prefix_cache_queried_tokens_total",
            "Prompt tokens looked up in this node's prefix cache.",
            labels,
            s.prefix_cache_queried_tokens,
        )
        yield counter(
            "pdserve_prefix_cache_hit_tokens_total",
            "Prompt tokens served from this node's prefix cache (verified hits).",
            labels,
            s.prefix_cache_hit_tokens,
        )


def _spec_decode(labels: dict[str, str], sd: SpecDecodeStats) -> Iterator[Metric]:
    """Speculative decoding's counters (vLLM's ``vllm:spec_decode_*`` names): the
    acceptance rate is accepted / draft tokens, the mean acceptance length
    1 + accepted / drafts."""
    yield counter(
        "pdserve_spec_decode_num_drafts_total",
        "Proposals verified (one per speculating sequence and step).",
        labels,
        sd.num_drafts,
    )
    yield counter(
        "pdserve_spec_decode_num_draft_tokens_total",
        "Tokens proposed.",
        labels,
        sd.num_draft_tokens,
    )
    yield counter(
        "pdserve_spec_decode_num_accepted_tokens_total",
        "Proposed tokens the target model kept.",
        labels,
        sd.num_accepted_tokens,
    )
    yield labelled_counter(
        "pdserve_spec_decode_num_accepted_tokens_per_pos_total",
        "Proposals whose token at this position was kept.",
        labels,
        "position",
        {str(i): n for i, n in enumerate(sd.accepted_per_pos)},
    )


def _grammar(labels: dict[str, str], g) -> Iterator[Metric]:
    """Structured outputs (engine/structured/): compiles, the grammar cache, matchers."""
    yield histogram(
        "pdserve_grammar_compile_duration_seconds",
        "Per grammar compiled (a grammar cache miss): seconds its compile took on the "
        "compile pool (failed compiles too).",
        labels,
        _Snapshot(g),
    )
    yield counter(
        "pdserve_grammar_cache_hits_total",
        "Structured requests whose grammar was in the cache (compiled, or compiling).",
        labels,
        g.cache_hits,
    )
    yield counter(
        "pdserve_grammar_cache_misses_total",
        "Structured requests whose grammar had to be compiled.",
        labels,
        g.cache_misses,
    )
    yield gauge(
        "pdserve_grammar_matchers",
        "Sequences holding grammar state (compiling or matching); 0 at idle.",
        labels,
        g.num_matchers,
    )


class _Snapshot:
    """The engine's GrammarStats as a histogram families.histogram reads."""

    def __init__(self, g) -> None:
        self.g = g

    def snapshot(self):
        return self.g
