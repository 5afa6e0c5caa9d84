"""EngineStats: a snapshot of one engine's load and cache, taken between steps.

The nodes publish it (heartbeat, Prometheus, progress lines); it is plain data,
so reading it never touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.spec_decode.speculator import SpecDecodeStats


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_reserved: int
    num_queued_prefill_tokens: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_cached_free_kv_blocks: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    # For throughput lines (common/runtime/progress_log.py): tokens run through the
    # model, and tokens sampled; their difference is prompt work.
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    # Blocks freed before a sliding window (models whose layers all slide).
    num_window_freed_blocks: int = 0
    # Speculative decoding's counters since start (None: not configured).
    spec_decode: SpecDecodeStats | None = None


def collect_stats(
    sched: Scheduler,
    bm: BlockManager,
    num_computed_tokens: int,
    num_generated_tokens: int,
    spec_decode: SpecDecodeStats | None = None,
) -> EngineStats:
    """The snapshot now. Queued prefill tokens count the waiting prompts and the
    unfinished chunks of running ones (a decode row has one uncomputed token)."""
    queued = sum(seq.num_uncomputed_tokens for seq in sched.waiting)
    queued += sum(
        seq.num_uncomputed_tokens for seq in sched.running if seq.num_uncomputed_tokens > 1
    )
    s = sched.stats
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_reserved=len(sched.reserved),
        num_queued_prefill_tokens=queued,
        num_kv_blocks=bm.num_blocks,
        num_free_kv_blocks=bm.num_free_blocks,
        num_cached_free_kv_blocks=bm.num_cached_free_blocks,
        num_preemptions=s.num_preemptions,
        prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=s.prefix_cache_hit_tokens,
        num_computed_tokens=num_computed_tokens,
        num_generated_tokens=num_generated_tokens,
        num_window_freed_blocks=s.num_window_freed_blocks,
        spec_decode=spec_decode,
    )
