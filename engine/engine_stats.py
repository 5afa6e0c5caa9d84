"""EngineStats: a snapshot of one engine's load and cache, taken between steps.

The nodes publish it (heartbeat, Prometheus, progress lines); it is plain data,
so reading it never touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.spec_decode.speculator import SpecDecodeStats
from engine.structured.compiler import GrammarStats


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
    # The host tier (swap_space; all 0 without one): its slots, the free ones
    # (empty or evictable cached), prefix blocks served from it, blocks and
    # bytes copied each way, and preemptions by swap and those that fell back
    # to recompute because the tier could not take the victim.
    num_host_kv_blocks: int = 0
    num_free_host_kv_blocks: int = 0
    host_tier_hit_blocks: int = 0
    num_blocks_copied_to_host: int = 0
    num_blocks_copied_to_device: int = 0
    bytes_copied_to_host: int = 0
    bytes_copied_to_device: int = 0
    # Rank 0's seconds on the bus for the copies to the device (its bytes over
    # these: the tier's copy-in rate; with tensor parallelism, one rank's).
    seconds_copying_to_device: float = 0.0
    num_swap_preemptions: int = 0
    num_swap_fallbacks: int = 0
    # Weights kept in host memory and streamed per layer (cpu_offload_gb; per rank).
    offloaded_weight_bytes: int = 0
    # Speculative decoding's counters since start (None: not configured).
    spec_decode: SpecDecodeStats | None = None
    # Structured outputs: compile times, grammar cache hits/misses, matchers alive.
    grammar: GrammarStats = field(default_factory=GrammarStats)


def collect_stats(
    sched: Scheduler,
    bm: BlockManager,
    num_computed_tokens: int,
    num_generated_tokens: int,
    kv_block_bytes: int = 0,
    spec_decode: SpecDecodeStats | None = None,
    grammar: GrammarStats | None = None,
) -> EngineStats:
    """The snapshot now. Queued prefill tokens count the waiting prompts and the
    unfinished chunks of running ones (a decode row has one uncomputed token).
    ``kv_block_bytes``: one block's bytes, all tensor-parallel ranks' heads
    together (what the host tier's copies move)."""
    queued = sum(seq.num_uncomputed_tokens for seq in sched.waiting)
    queued += sum(
        seq.num_uncomputed_tokens for seq in sched.running if seq.num_uncomputed_tokens > 1
    )
    s = sched.stats
    stats = EngineStats(
        # A sequence loading from the host tier holds a slot and blocks like a
        # running one; a swapped-out one waits to resume.
        num_running=len(sched.running) + len(sched.loading),
        num_waiting=len(sched.waiting) + len(sched.swapped),
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
        num_swap_preemptions=s.num_swap_preemptions,
        num_swap_fallbacks=s.num_swap_fallbacks,
        spec_decode=spec_decode,
        grammar=grammar or GrammarStats(),
    )
    tier = bm.host_tier
    if tier is not None:
        t = tier.stats
        stats.num_host_kv_blocks = tier.num_slots
        stats.num_free_host_kv_blocks = tier.num_free_slots
        stats.host_tier_hit_blocks = t.hit_blocks
        stats.num_blocks_copied_to_host = t.blocks_to_host
        stats.num_blocks_copied_to_device = t.blocks_to_device
        stats.bytes_copied_to_host = t.blocks_to_host * kv_block_bytes
        stats.bytes_copied_to_device = t.blocks_to_device * kv_block_bytes
        stats.seconds_copying_to_device = t.seconds_to_device
    return stats
