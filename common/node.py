"""What both node kinds share: building the engine from flags, heartbeats to Redis.

A heartbeat publishes the node's load and the block hashes its prefix cache
stored and evicted since the last one, in one Redis round trip. When Redis is
unreachable the node keeps serving and retries with backoff; the events it
could not publish are kept and sent with the next successful heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.cluster import Cluster, NodeInfo, NodeRole
from common.engine.engine_thread import EngineThread

logger = logging.getLogger(__name__)

# Engine options a node takes from its command line (EngineConfig names).
ENGINE_FLAGS: dict[str, type] = {
    "max_model_len": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "kvcache_block_size": int,
    "num_kvcache_blocks": int,
    "gpu_memory_utilization": float,
    "dtype": str,
    "device": str,
    "attention_backend": str,
    "served_model_name": str,
    "seed": int,
    "load_format": str,
}


def add_engine_flags(parser: Any) -> None:
    for name, kind in ENGINE_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    parser.add_argument("--enforce-eager", action="store_true", default=None)
    parser.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        default=None,
        help="no tokenizer: token ids in, token ids out (dummy-weight models)",
    )


def engine_kwargs(args: Any) -> dict[str, Any]:
    out = {n: getattr(args, n) for n in ENGINE_FLAGS if getattr(args, n, None) is not None}
    for flag in ("enforce_eager", "skip_tokenizer_init"):
        if getattr(args, flag, None):
            out[flag] = True
    return out


def default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


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
    published: int = 0
    # Cache changes not yet published (kept across failed heartbeats); last wins.
    _pending: dict[bytes, bool] = field(default_factory=dict)
    _reset: bool = True

    def refresh_info(self) -> NodeInfo:
        s = self.engine.stats
        info = self.info
        info.kv_blocks_total = s.num_kv_blocks
        info.kv_blocks_free = s.num_free_kv_blocks
        info.running = s.num_running + s.num_reserved
        info.waiting = s.num_waiting
        info.queued_prefill_tokens = s.num_queued_prefill_tokens
        info.preemptions = s.num_preemptions
        for name, value in (self.counters() if self.counters else {}).items():
            setattr(info, name, value)
        return info

    async def beat(self) -> None:
        events = await asyncio.wrap_future(
            self.engine.call(lambda e: e.block_manager.take_events())
        )
        for h in events.removed:  # the two lists are disjoint
            self._pending.pop(h, None)
            self._pending[h] = False
        for h in events.stored:
            self._pending.pop(h, None)
            self._pending[h] = True
        stored = [h for h, v in self._pending.items() if v]
        removed = [h for h, v in self._pending.items() if not v]
        await self.cluster.heartbeat(
            self.refresh_info(), stored=stored, removed=removed, reset_blocks=self._reset
        )
        self._pending.clear()
        self._reset = False
        self.published += 1

    async def run_forever(self) -> None:
        while True:
            try:
                await self.beat()
                if self.consecutive_failures:
                    logger.info("Redis reachable again; heartbeats resumed")
                self.consecutive_failures = 0
                await asyncio.sleep(self.interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.consecutive_failures += 1
                delay = min(self.max_backoff_s, self.interval_s * 2**self.consecutive_failures)
                logger.warning("heartbeat to Redis failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)

    async def deregister(self) -> None:
        for attempt in range(2):  # a pooled connection may have died with the heartbeat task
            try:
                await self.cluster.deregister(self.info.node_id)
                return
            except Exception as e:
                if attempt:  # leaving anyway; the TTL removes us
                    logger.warning("could not deregister from Redis: %s", e)


def make_node_info(
    role: NodeRole, node_id: str, address: str, model_id: str, block_size: int, **kw: Any
) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, role=role, address=address, model_id=model_id, block_size=block_size, **kw
    )
