"""A node's heartbeat: its load and prefix-cache changes, published to Redis.

A heartbeat publishes the node's load and the block hashes its prefix cache
stored and evicted since the last one -- for the device pool and for the
host tier (``--swap-space``) apart -- in one Redis round trip. When Redis is
unreachable the node keeps serving and retries with backoff; the events it
could not publish are kept and sent with the next successful heartbeat.

A node that goes idle publishes at once rather than at its next beat: its last
request would otherwise read as running (``pdctl nodes``, a router's load) for
up to an interval after its client had the answer. The engine thread wakes the
beat when a step finishes a request and leaves the engine idle
(``watch_idle``); no message waits for it. Under load a node is never idle, so
this costs nothing there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from common.cluster.state import Cluster, NodeInfo
from engine.engine_thread import EngineThread

logger = logging.getLogger(__name__)


@dataclass
class Heartbeat:
    """Publishes a node's state to Redis every ``interval_s`` seconds."""

    cluster: Cluster
    engine: EngineThread
    info: NodeInfo
    interval_s: float = 0.5
    max_backoff_s: float = 5.0
    # Returns the node's counters (NodeInfo field names) for each heartbeat.
    counters: Callable[[], dict[str, int]] | None = None
    consecutive_failures: int = 0
    failures: int = 0  # since start (pdserve_redis_errors_total)
    published: int = 0
    # Cache changes not yet published (kept across failed heartbeats); last wins.
    _pending: dict[bytes, bool] = field(default_factory=dict)
    _host_pending: dict[bytes, bool] = field(default_factory=dict)
    _reset: bool = True
    # After failed heartbeats Redis may have restarted empty: republish every
    # cached block hash (not only the changes) with the next beat that succeeds.
    _resync: bool = False
    # One beat at a time: shutdown beats at once (to publish `draining`) while
    # the periodic task may be mid-beat, and both edit `_pending`.
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # A take of cache events queued on the engine thread and not yet answered.
    _events_future: Future | None = None
    # Set to beat now rather than at the end of the interval (watch_idle).
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def watch_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Beat at once when an engine step finishes a request and leaves the
        engine with nothing to do (the hook runs on the engine thread)."""

        def after_step(outputs) -> None:
            if any(o.finished for o in outputs) and not self.engine.engine.has_work():
                loop.call_soon_threadsafe(self._wake.set)

        self.engine.after_step.append(after_step)

    def refresh_info(self) -> NodeInfo:
        s = self.engine.stats
        info = self.info
        info.kv_blocks_total = s.num_kv_blocks
        info.kv_blocks_free = s.num_free_kv_blocks
        info.running = s.num_running + s.num_reserved
        info.waiting = s.num_waiting
        info.queued_prefill_tokens = s.num_queued_prefill_tokens
        info.host_kv_blocks_total = s.num_host_kv_blocks
        info.host_kv_blocks_free = s.num_free_host_kv_blocks
        info.preemptions = s.num_preemptions
        info.computed_tokens = s.num_computed_tokens
        info.generated_tokens = s.num_generated_tokens
        if s.spec_decode is not None:
            info.spec_drafts = s.spec_decode.num_drafts
            info.spec_draft_tokens = s.spec_decode.num_draft_tokens
            info.spec_accepted_tokens = s.spec_decode.num_accepted_tokens
        for name, value in (self.counters() if self.counters else {}).items():
            setattr(info, name, value)
        return info

    async def beat(self) -> None:
        async with self._lock:
            await self._beat()

    async def _beat(self) -> None:
        if self._resync:
            # Queued after any take still outstanding, so this snapshot supersedes it.
            self._events_future = None
            events = await asyncio.wrap_future(self.engine.call(lambda e: e.cached_block_hashes()))
            self._pending.clear()
            self._host_pending.clear()
            self._reset = True
            self._resync = False
        else:
            events = await self._cache_events()
        if events is not None:
            _merge(self._pending, events.stored, events.removed)
            _merge(self._host_pending, events.host_stored, events.host_removed)
        stored, removed = _split(self._pending)
        host_stored, host_removed = _split(self._host_pending)
        await self.cluster.heartbeat(
            self.refresh_info(),
            stored=stored,
            removed=removed,
            reset_blocks=self._reset,
            host_stored=host_stored,
            host_removed=host_removed,
        )
        self._pending.clear()
        self._host_pending.clear()
        self._reset = False
        self.published += 1

    async def _cache_events(self):
        """The block manager's changes since the last take, or None when the
        engine is in the middle of a long step: the beat goes out with the load
        anyway and the changes follow with a later one. A heartbeat must not
        wait for a step -- routers take a node silent for a few seconds for a
        dead one, and a step over hundreds of sequences on a CPU can take that
        long."""
        if self._events_future is None:
            self._events_future = self.engine.call(lambda e: e.take_cache_events())
        waiting = asyncio.shield(asyncio.wrap_future(self._events_future))
        try:
            events = await asyncio.wait_for(waiting, timeout=max(0.05, self.interval_s))
        except TimeoutError:
            return None
        self._events_future = None
        return events

    async def run_forever(self) -> None:
        task = asyncio.current_task()
        # Checked on every turn, not only through CancelledError: the Redis
        # client can swallow a cancellation that lands mid-read (or turn it
        # into another error), and a heartbeat loop that outlives its
        # cancellation would hang the node's shutdown.
        while not task.cancelling():
            try:
                await self.beat()
                if self.consecutive_failures:
                    logger.info("Redis reachable again; heartbeats resumed")
                self.consecutive_failures = 0
                with contextlib.suppress(TimeoutError):  # the interval, or a wake
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
                self._wake.clear()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if task.cancelling():
                    break
                self.consecutive_failures += 1
                self._resync = True
                self.failures += 1
                delay = min(self.max_backoff_s, self.interval_s * 2**self.consecutive_failures)
                logger.warning("heartbeat to Redis failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
        raise asyncio.CancelledError

    async def deregister(self) -> None:
        for attempt in range(2):  # a pooled connection may have died with the heartbeat task
            try:
                await self.cluster.deregister(self.info.node_id)
                return
            except Exception as e:
                if attempt:  # leaving anyway; the TTL removes us
                    logger.warning("could not deregister from Redis: %s", e)


def _merge(pending: dict[bytes, bool], stored: list[bytes], removed: list[bytes]) -> None:
    """Fold one take of events into the unpublished ones (the two lists are disjoint)."""
    for h in removed:
        pending.pop(h, None)
        pending[h] = False
    for h in stored:
        pending.pop(h, None)
        pending[h] = True


def _split(pending: dict[bytes, bool]) -> tuple[list[bytes], list[bytes]]:
    return [h for h, v in pending.items() if v], [h for h, v in pending.items() if not v]
