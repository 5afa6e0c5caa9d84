"""LoRA adapters loaded and unloaded on every node (router/lora_admin.py), over
real grpc.aio servers on localhost standing in for the nodes' NodeControl:
all or nothing on load (a failing node is named, the others unload it
again; nodes that read other files roll back too), unload everywhere, and
the refusals before any node is called."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.cluster.state import NodeInfo, NodeRole, lora_adapters_json, lora_resident_json
from pdserve.redis_server import free_port
from proto import internal_pb2, internal_pb2_grpc
from router.lora_admin import LoRAAdmin, LoRAUpdateFailed


class FakeNode(internal_pb2_grpc.NodeControlServicer):
    """A node's LoRA state and what it was asked; ``refuse``: (code, message) for loads."""

    def __init__(self, node_id: str, role: NodeRole, digest: str = "d1") -> None:
        self.node_id, self.role, self.digest = node_id, role, digest
        self.port = free_port()
        self.adapters: dict[str, str] = {}
        self.resident: list[str] = []
        self.refuse: tuple[grpc.StatusCode, str] | None = None
        self.calls: list[tuple[str, str]] = []
        self.in_flight = 0

    async def LoadLoRA(self, request, context):
        self.calls.append(("load", request.name))
        if self.refuse is not None:
            await context.abort(*self.refuse)
        self.adapters[request.name] = self.digest
        return internal_pb2.NodeLoRAResponse(name=request.name, digest=self.digest, rank=4)

    async def UnloadLoRA(self, request, context):
        self.calls.append(("unload", request.name))
        if self.adapters.pop(request.name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node {self.node_id} has none")
        return internal_pb2.NodeLoRAResponse(name=request.name, requests_in_flight=self.in_flight)

    def info(self) -> NodeInfo:
        return NodeInfo(
            node_id=self.node_id,
            role=self.role,
            address=f"127.0.0.1:{self.port}",
            model_id="m",
            block_size=16,
            lora_adapters=lora_adapters_json(self.adapters),
            lora_resident=lora_resident_json(self.resident),
        )


class FakeCluster:
    def __init__(self, nodes: list[FakeNode]) -> None:
        self.fakes = nodes

    async def nodes(self) -> list[NodeInfo]:
        return [n.info() for n in self.fakes]


class FakeRouting:
    model_id = "m"
    reads = 0

    async def read_nodes(self) -> None:
        self.reads += 1


def run(test) -> None:
    """``test(admin, nodes, routing)`` against a prefill and a decode node."""

    async def main():
        nodes = [FakeNode("p0", NodeRole.PREFILL), FakeNode("d0", NodeRole.DECODE)]
        servers, channels = [], {}
        for node in nodes:
            server = grpc.aio.server()
            internal_pb2_grpc.add_NodeControlServicer_to_server(node, server)
            server.add_insecure_port(f"127.0.0.1:{node.port}")
            await server.start()
            servers.append(server)

        def channel(address: str):
            if address not in channels:
                channels[address] = grpc.aio.insecure_channel(address)
            return channels[address]

        routing = FakeRouting()
        try:
            await test(LoRAAdmin(FakeCluster(nodes), routing, channel), nodes, routing)
        finally:
            for c in channels.values():
                await c.close()
            for s in servers:
                await s.stop(None)

    asyncio.run(asyncio.wait_for(main(), 30))


async def refused(work) -> LoRAUpdateFailed:
    with pytest.raises(LoRAUpdateFailed) as info:
        await work
    return info.value


def test_load_reaches_every_node_and_unload_drains_them():
    async def test(admin, nodes, routing):
        adapter = await admin.load("sql", "/a")
        assert (adapter.name, adapter.digest, list(adapter.node_ids)) == ("sql", "d1", ["d0", "p0"])
        assert all(n.adapters == {"sql": "d1"} for n in nodes) and routing.reads == 1
        nodes[1].resident = ["sql"]
        [listed] = await admin.list()
        assert list(listed.node_ids) == ["d0", "p0"] and list(listed.resident_node_ids) == ["d0"]
        e = await refused(admin.load("sql", "/b"))
        assert e.code == grpc.StatusCode.ALREADY_EXISTS and "already been loaded" in str(e)
        assert all(n.calls == [("load", "sql")] for n in nodes)  # refused before any node
        nodes[0].in_flight, nodes[1].in_flight = 2, 1
        adapter, in_flight = await admin.unload("sql")
        assert in_flight == 3 and list(adapter.node_ids) == ["d0", "p0"]
        assert all(not n.adapters for n in nodes) and await admin.list() == []
        e = await refused(admin.unload("sql"))
        assert e.code == grpc.StatusCode.NOT_FOUND and "cannot be found" in str(e)

    run(test)


def test_a_node_that_fails_the_load_is_named_and_the_others_unload_it():
    async def test(admin, nodes, routing):
        nodes[1].refuse = (grpc.StatusCode.INVALID_ARGUMENT, "node d0: rank 64 above 16")
        e = await refused(admin.load("sql", "/a"))
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(e) == (
            "loading the LoRA adapter 'sql' failed on node d0: rank 64 above 16; "
            "unloaded again from p0"
        )
        assert nodes[0].calls == [("load", "sql"), ("unload", "sql")]
        assert not nodes[0].adapters and not nodes[1].adapters and routing.reads == 0
        # A node that did not say who it is gets named all the same.
        nodes[0].refuse = nodes[1].refuse = (grpc.StatusCode.NOT_FOUND, "no such path")
        e = await refused(admin.load("sql", "/gone"))
        assert e.code == grpc.StatusCode.NOT_FOUND
        assert "failed on d0: no such path; p0: no such path" in str(e)

    run(test)


def test_nodes_that_read_different_files_load_nothing():
    async def test(admin, nodes, routing):
        nodes[1].digest = "d2"
        e = await refused(admin.load("sql", "/a"))
        assert e.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "d0 read d2, p0 read d1" in str(e) and "same adapter on every node" in str(e)
        assert all(not n.adapters for n in nodes)

    run(test)


def test_bad_requests_are_refused_before_any_node_is_called():
    async def test(admin, nodes, routing):
        for name, path in (("", "/a"), ("sql", ""), ("m", "/a")):
            e = await refused(admin.load(name, path))
            assert e.code == grpc.StatusCode.INVALID_ARGUMENT
        assert all(not n.calls for n in nodes)

    run(test)
