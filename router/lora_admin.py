"""LoRA adapters loaded and unloaded at run time, on every node at once: what
the admin API's LoadLoRAAdapter / UnloadLoRAAdapter / ListLoRAAdapters and the
OpenAI API's /v1/load_lora_adapter and /v1/unload_lora_adapter do.

Load is all or nothing: each live node of the served model loads the adapter
(NodeControl.LoadLoRA, concurrently); when one fails, or the nodes read
different files (digests), the nodes that loaded it unload it again and the
error names every failing node. A node publishes its registration before it
answers, so the registry read after the fan-out shows the adapter, and
/v1/models and routing agree from then on.

Unload reaches every node that registered the name; each refuses new
requests for it at once and lets those in flight finish (drain).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.cluster.state import Cluster, NodeInfo, lora_adapters_of, lora_resident_of
from proto import admin_pb2, internal_pb2, internal_pb2_grpc
from router.models import served_adapters
from router.routing import Routing

# A node reads and checks the adapter's files before it answers.
NODE_CALL_TIMEOUT_S = 120.0


class LoRAUpdateFailed(Exception):
    """A load or unload refused or failed, with the status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class NodeResult:
    node: NodeInfo
    reply: internal_pb2.NodeLoRAResponse | None = None
    error: grpc.aio.AioRpcError | None = None


class LoRAAdmin:
    def __init__(self, cluster: Cluster, routing: Routing, channel: Callable) -> None:
        self.cluster = cluster
        self.routing = routing
        self.channel = channel  # address -> grpc.aio.Channel (shared with the router)

    async def list(self) -> list[admin_pb2.LoRAAdapter]:
        nodes = await self._nodes()
        return [
            _adapter(name, digest, nodes)
            for name, digest in served_adapters(nodes, self._model).items()
        ]

    async def load(self, name: str, path: str) -> admin_pb2.LoRAAdapter:
        if not name or not path:
            raise LoRAUpdateFailed(
                grpc.StatusCode.INVALID_ARGUMENT, "both lora_name and lora_path must be given"
            )
        if name == self._model:
            raise LoRAUpdateFailed(
                grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} is the base model's name"
            )
        nodes = await self._nodes()
        holders = [n.node_id for n in nodes if name in lora_adapters_of(n)]
        if holders:
            raise LoRAUpdateFailed(
                grpc.StatusCode.ALREADY_EXISTS,
                f"the LoRA adapter {name!r} has already been loaded (on {', '.join(holders)})",
            )
        request = internal_pb2.NodeLoadLoRARequest(name=name, path=path)
        results = await self._fan_out(nodes, "LoadLoRA", request)
        loaded = [r for r in results if r.reply is not None]
        failed = [r for r in results if r.error is not None]
        digests = {r.reply.digest for r in loaded}
        if failed or len(digests) > 1:
            await self._fan_out([r.node for r in loaded], "UnloadLoRA", _unload(name))
            raise _load_failure(name, failed, loaded)
        await self.routing.read_nodes()  # this router's map of adapters, now
        return admin_pb2.LoRAAdapter(
            name=name, digest=digests.pop(), node_ids=[r.node.node_id for r in loaded]
        )

    async def unload(self, name: str) -> tuple[admin_pb2.LoRAAdapter, int]:
        """The adapter as the nodes held it, and its requests still in flight."""
        nodes = await self._nodes()
        holders = [n for n in nodes if name in lora_adapters_of(n)]
        if not name or not holders:
            raise LoRAUpdateFailed(
                grpc.StatusCode.NOT_FOUND, f"the LoRA adapter {name!r} cannot be found"
            )
        digest = served_adapters(holders, self._model).get(name, "")
        # Every holder, whatever files it read: all of them unload it.
        adapter = admin_pb2.LoRAAdapter(
            name=name, digest=digest, node_ids=[n.node_id for n in holders]
        )
        results = await self._fan_out(holders, "UnloadLoRA", _unload(name))
        # NOT_FOUND: that node unloaded it meanwhile (another router's call).
        failed = [
            r
            for r in results
            if r.error is not None and r.error.code() != grpc.StatusCode.NOT_FOUND
        ]
        await self.routing.read_nodes()
        if failed:
            raise LoRAUpdateFailed(
                failed[0].error.code(),
                f"unloading the LoRA adapter {name!r} failed on "
                + _reasons(failed)
                + " (the other nodes unloaded it)",
            )
        return adapter, sum(r.reply.requests_in_flight for r in results if r.reply is not None)

    @property
    def _model(self) -> str:
        return self.routing.model_id

    async def _nodes(self) -> list[NodeInfo]:
        try:
            nodes = await self.cluster.nodes()
        except Exception as e:
            raise LoRAUpdateFailed(
                grpc.StatusCode.UNAVAILABLE, f"cluster state is unavailable: {e}"
            ) from e
        nodes = [n for n in nodes if n.model_id == self._model]
        if not nodes:
            raise LoRAUpdateFailed(
                grpc.StatusCode.UNAVAILABLE, f"no live node serves {self._model!r}"
            )
        return sorted(nodes, key=lambda n: n.node_id)

    async def _fan_out(self, nodes: list[NodeInfo], method: str, request) -> list[NodeResult]:
        async def call(node: NodeInfo) -> NodeResult:
            stub = internal_pb2_grpc.NodeControlStub(self.channel(node.address))
            try:
                reply = await getattr(stub, method)(request, timeout=NODE_CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                return NodeResult(node, error=e)
            return NodeResult(node, reply=reply)

        return list(await asyncio.gather(*(call(n) for n in nodes)))


def _unload(name: str) -> internal_pb2.NodeUnloadLoRARequest:
    return internal_pb2.NodeUnloadLoRARequest(name=name)


def _adapter(name: str, digest: str, nodes: list[NodeInfo]) -> admin_pb2.LoRAAdapter:
    holders = [n for n in nodes if lora_adapters_of(n).get(name) == digest]
    return admin_pb2.LoRAAdapter(
        name=name,
        digest=digest,
        node_ids=[n.node_id for n in holders],
        resident_node_ids=[n.node_id for n in holders if name in lora_resident_of(n)],
    )


def _load_failure(
    name: str, failed: list[NodeResult], loaded: list[NodeResult]
) -> LoRAUpdateFailed:
    """The status of the first failing node, the message naming each."""
    undone = f"; unloaded again from {', '.join(r.node.node_id for r in loaded)}" if loaded else ""
    if failed:
        reasons = _reasons(failed)
        return LoRAUpdateFailed(
            failed[0].error.code(), f"loading the LoRA adapter {name!r} failed on {reasons}{undone}"
        )
    by_node = ", ".join(f"{r.node.node_id} read {r.reply.digest}" for r in loaded)
    return LoRAUpdateFailed(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"the nodes read different files for the LoRA adapter {name!r} ({by_node}): its path "
        f"must hold the same adapter on every node{undone}",
    )


def _reasons(failed: list[NodeResult]) -> str:
    """Each failing node's message, named (a node's own messages name it already)."""
    out = []
    for r in failed:
        details = r.error.details() or r.error.code().name
        out.append(details if r.node.node_id in details else f"{r.node.node_id}: {details}")
    return "; ".join(out)
