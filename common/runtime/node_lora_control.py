"""Loading and unloading a node's LoRA adapters while it serves (NodeControl's
LoadLoRA and UnloadLoRA; the router's admin API fans them out to every node).

Load: the adapter's files are read and checked on a worker thread (disk IO
and the checks never hold up an engine step), the engine thread only files
the tensors it got (``LLMEngine.add_lora(request, adapter)``), then the name
joins the node's adapters and the node publishes its registration before it
answers, so that a router reading the registry after the answer routes to it.

Unload: the name leaves the node's adapters and its registration first
(requests naming it are refused from then on, NOT_FOUND), then the engine
forgets it; requests already in flight finish on its weights, which are freed
after the last (``LLMEngine.remove_lora``: drain, never a failed request).

Each load takes a new ``lora_int_id``: an id always means the same files.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from common.cluster.state import NodeInfo, lora_adapters_json, lora_resident_json
from common.runtime.node_lora import AdapterRefused, NodeAdapters
from engine.engine_thread import EngineThread
from engine.lora.adapter import LoRAAdapterError, LoRAAdapterNotFound
from engine.lora.request import LoRARequest
from proto import internal_pb2

logger = logging.getLogger(__name__)


class NodeLoRAControl:
    def __init__(self, thread: EngineThread, adapters: NodeAdapters, info: NodeInfo) -> None:
        self.thread = thread
        self.adapters = adapters
        self.info = info
        # Publishes the registration now (the heartbeat's beat, set once it runs).
        self.publish: Callable[[], Awaitable[None]] | None = None
        # One load or unload at a time: each reads, then changes, the names.
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str) -> internal_pb2.NodeLoRAResponse:
        """AdapterRefused with the status for every refusal (module docstring)."""
        manager = self.thread.engine.model_runner.lora
        node_id = self.info.node_id
        if manager is None:
            raise AdapterRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id} was started without --enable-lora: it cannot load adapters",
            )
        async with self._lock:
            if name in self.adapters.by_name:
                raise AdapterRefused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"node {node_id} has a LoRA adapter {name!r} already; unload it first",
                )
            try:
                request = LoRARequest(name, self.adapters.next_id, path)
                loop = asyncio.get_running_loop()
                adapter = await loop.run_in_executor(None, manager.read, request)
                await asyncio.wrap_future(self.thread.call(lambda e: e.add_lora(request, adapter)))
            except LoRAAdapterNotFound as e:
                raise AdapterRefused(grpc.StatusCode.NOT_FOUND, f"node {node_id}: {e}") from e
            except (LoRAAdapterError, ValueError) as e:
                raise AdapterRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"node {node_id}: {e}"
                ) from e
            self.adapters.add(request, adapter.digest)
            await self._publish()
        logger.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.rank)
        return internal_pb2.NodeLoRAResponse(name=name, digest=adapter.digest, rank=adapter.rank)

    async def unload(self, name: str) -> internal_pb2.NodeLoRAResponse:
        async with self._lock:
            known = self.adapters.by_name.pop(name, None)
            if known is None:
                raise AdapterRefused(
                    grpc.StatusCode.NOT_FOUND,
                    f"node {self.info.node_id} has no LoRA adapter {name!r} "
                    f"(has: {sorted(self.adapters.by_name)})",
                )
            request, digest = known
            await self._publish()
            lora_int_id = request.lora_int_id

            def remove(engine) -> int:
                engine.remove_lora(lora_int_id)
                return engine.lora_requests_in_flight(lora_int_id)

            in_flight = await asyncio.wrap_future(self.thread.call(remove))
        logger.info("LoRA adapter %r unloaded (%d requests finish on it)", name, in_flight)
        return internal_pb2.NodeLoRAResponse(name=name, digest=digest, requests_in_flight=in_flight)

    def counters(self, counters: Callable[[], dict]) -> Callable[[], dict]:
        """The heartbeat's per-beat fields: the node's counters, and which
        adapters hold a device slot now (NodeInfo.lora_resident)."""

        def with_resident() -> dict:
            resident = self.adapters.resident(self.thread.engine)
            return {**counters(), "lora_resident": lora_resident_json(resident)}

        return with_resident

    async def _publish(self) -> None:
        self.info.lora_adapters = lora_adapters_json(self.adapters.digests())
        if self.publish is None:
            return
        try:
            await self.publish()
        except Exception as e:  # Redis down: the next heartbeat that gets through has it
            logger.warning("could not publish the LoRA adapters now (%s); a later beat will", e)
