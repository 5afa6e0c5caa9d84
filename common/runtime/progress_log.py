"""A node's periodic progress line while it is busy (vLLM's engine logs one):

    decode-0: prompt 812.4 tok/s, generation 96.1 tok/s, running 3, waiting 1,
    KV usage 12.5%, prefix hits 40.0%

Read from the engine thread's stats snapshot (never the engine itself), every
``interval_s``; a node that ran nothing since the last line says nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from engine.engine_stats import EngineStats
from engine.engine_thread import EngineThread

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0


@dataclass(slots=True)
class Progress:
    """What one line says: rates over the interval, the rest as of now."""

    prompt_tps: float
    generation_tps: float
    running: int
    waiting: int
    kv_usage: float  # 0..1 of the pool held by requests
    prefix_hit_rate: float  # 0..1 over the interval's lookups

    @property
    def busy(self) -> bool:
        return bool(self.prompt_tps or self.generation_tps or self.running or self.waiting)

    def line(self, name: str) -> str:
        return (
            f"{name}: prompt {self.prompt_tps:.1f} tok/s, generation {self.generation_tps:.1f} "
            f"tok/s, running {self.running}, waiting {self.waiting}, "
            f"KV usage {self.kv_usage:.1%}, prefix hits {self.prefix_hit_rate:.1%}"
        )


def progress_between(before: EngineStats, now: EngineStats, seconds: float) -> Progress:
    seconds = max(seconds, 1e-9)
    generated = now.num_generated_tokens - before.num_generated_tokens
    computed = now.num_computed_tokens - before.num_computed_tokens
    queried = now.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens
    hits = now.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    used = now.num_kv_blocks - now.num_free_kv_blocks
    return Progress(
        # Every computed token that was not a decode step's is prompt work.
        prompt_tps=max(computed - generated, 0) / seconds,
        generation_tps=generated / seconds,
        running=now.num_running,
        waiting=now.num_waiting,
        kv_usage=used / now.num_kv_blocks if now.num_kv_blocks else 0.0,
        prefix_hit_rate=hits / queried if queried else 0.0,
    )


async def log_progress(thread: EngineThread, name: str, interval_s: float) -> None:
    """Log a progress line every ``interval_s`` while the node is busy (until cancelled)."""
    if interval_s <= 0:
        return
    before, since = thread.stats, time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now, at = thread.stats, time.monotonic()
        progress = progress_between(before, now, at - since)
        if progress.busy:
            logger.info("%s", progress.line(name))
        before, since = now, at
