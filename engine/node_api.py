"""What the service's nodes ask of an engine beyond requests and steps:
queue room, KV-write observation, worker calls, held blocks, prefix-cache
events. A base of ``LLMEngine`` (engine/llm_engine.py), kept apart so that
file keeps to the step-level API."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager, CacheEvents
from engine.kv_writes import KVWriteObserver
from engine.parallel.handoff import Call

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.scheduler import Scheduler
    from engine.tp_workers import TPWorkers


class NodeAPI:
    config: EngineConfig
    scheduler: Scheduler
    block_manager: BlockManager
    model_runner: ModelRunner
    tp_workers: TPWorkers | None

    def _raise_if_a_rank_died(self, error: Exception) -> None:
        if self.tp_workers is not None:
            self.tp_workers.raise_if_dead(error)

    def queue_room(self) -> tuple[int, int]:
        """(requests waiting, free sequence slots): what a node's queue bound needs."""
        return len(self.scheduler.waiting), self.scheduler.num_free_slots

    def observe_kv_writes(self, observer: KVWriteObserver | None) -> None:
        """Prefill node: be told when each layer's KV is written (None: stop).
        With tensor parallelism this is rank 0's; the others install their own
        through their worker extension."""
        self.model_runner.kv_observer = observer

    def call_workers(self, method: str, payload: dict) -> None:
        """``method(payload)`` on the worker extension of every rank but this one
        (``worker_extension_cls``), before the next step; a no-op without tensor
        parallelism. Engine thread only. ``payload`` travels as JSON."""
        if self.tp_workers is None:
            return
        if not self.config.worker_extension_cls:
            raise ValueError("call_workers needs worker_extension_cls in the engine's config")
        call = Call(method, json.dumps(payload, separators=(",", ":")).encode())
        try:
            self.model_runner.handoff.call(call)
        except Exception as e:
            self._raise_if_a_rank_died(e)
            raise

    def num_held(self) -> int:
        """Prefill node: finished requests whose blocks wait for their transfer."""
        return len(self.scheduler.held)

    def enable_cache_events(self) -> None:
        """Record the block hashes the prefix cache stores and evicts (for Redis)."""
        self.block_manager.enable_events()

    def take_cache_events(self) -> CacheEvents:
        """The prefix cache's changes since the last take."""
        return self.block_manager.take_events()

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now; the events so far are
        superseded by this snapshot (a node republishing after a Redis outage)."""
        self.block_manager.take_events()
        return self.block_manager.cached_hashes()
