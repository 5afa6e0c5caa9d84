"""The Admin service (own port, own token): cluster views and operations for pdctl.

Thin: state lives in Redis (nodes, drain marks) and in the router's Routing
object (in-flight counts, statistics); this file converts to and from protobuf.
"""

from __future__ import annotations

import time

import grpc

from common.cluster.state import Cluster, NodeInfo, NodeRole
from proto import admin_pb2, admin_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.frontend import Frontend
from router.lora_admin import LoRAAdmin, LoRAUpdateFailed
from router.models import ModelNotFound
from router.policy import NoRoute
from router.routing import Routing
from router.stats import summarize


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, cluster: Cluster, routing: Routing, frontend: Frontend, channel) -> None:
        self.cluster = cluster
        self.routing = routing
        self.frontend = frontend
        self.channel = channel  # address -> grpc.aio.Channel (shared with the router)
        self.lora = LoRAAdmin(cluster, routing, channel)
        self.started = time.monotonic()

    async def _nodes(self, context: grpc.aio.ServicerContext) -> list[NodeInfo]:
        return (await self._nodes_at(context))[1]

    async def _nodes_at(self, context) -> tuple[int, list[NodeInfo]]:
        try:
            return await self.cluster.nodes_at()
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster state is unavailable: {e}")

    async def _node(self, node_id: str, context) -> tuple[int, NodeInfo]:
        if not node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id is required")
        now, nodes = await self._nodes_at(context)
        for n in nodes:
            if n.node_id == node_id:
                return now, n
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no live node {node_id!r}")

    async def ListNodes(self, request, context):
        now, nodes = await self._nodes_at(context)
        counts = await self.cluster.block_counts([n.node_id for n in nodes])
        return admin_pb2.ListNodesResponse(
            nodes=[node_to_proto(n, counts.get(n.node_id, (0, 0)), now) for n in nodes]
        )

    async def Drain(self, request, context):
        now, node = await self._node(request.node_id, context)
        await self.cluster.drain(node.node_id)
        node.draining = True
        return admin_pb2.DrainResponse(node=node_to_proto(node, (0, 0), now))

    async def Undrain(self, request, context):
        if not request.node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node_id is required")
        # A drained node that is down can be undrained too (so it rejoins when back).
        was_drained = await self.cluster.undrain(request.node_id)
        now, nodes = await self._nodes_at(context)
        node = next((n for n in nodes if n.node_id == request.node_id), None)
        if node is None:
            if not was_drained:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node_id!r}")
            return admin_pb2.DrainResponse(node=admin_pb2.NodeInfo(node_id=request.node_id))
        return admin_pb2.DrainResponse(node=node_to_proto(node, (0, 0), now))

    async def Stats(self, request, context):
        s = self.routing.stats
        nodes = await self._nodes(context)
        prefills = [n for n in nodes if n.role is NodeRole.PREFILL]
        sent_bytes = sum(n.kv_transfer_bytes for n in prefills)
        sent_us = sum(n.kv_transfer_us for n in prefills)
        return admin_pb2.StatsResponse(
            ttft=latency(s.ttft_ms),
            tpot=latency(s.tpot_ms),
            itl=latency(s.itl_ms),
            e2e=latency(s.e2e_ms),
            prefix_hit_rate=s.prefix_hit_rate,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            requests_per_decode_node=counts(s.requests_by_decode_node),
            requests_per_prefill_node=counts(s.requests_by_prefill_node),
            local_prefills=s.local_prefills,
            requests_by_status=[
                admin_pb2.StatusCount(status=k, count=v)
                for k, v in sorted(s.requests_by_status.items())
            ],
            in_flight=self.routing.inflight.in_flight,
            preemptions=sum(n.preemptions for n in nodes),
            kv_transfers=sum(n.kv_transfers for n in prefills),
            kv_transfer_bytes=sent_bytes,
            kv_transfer_gbps=sent_bytes / (sent_us * 1e3) if sent_us else 0.0,
            kv_transfer_failures=sum(n.kv_transfer_failures for n in nodes),
            uptime_s=time.monotonic() - self.started,
            spec_drafts=sum(n.spec_drafts for n in nodes),
            spec_draft_tokens=sum(n.spec_draft_tokens for n in nodes),
            spec_accepted_tokens=sum(n.spec_accepted_tokens for n in nodes),
        )

    async def ExplainRoute(self, request, context):
        try:
            model = await self.routing.model(request.request.model)
        except ModelNotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        try:
            parsed = self.frontend.parse(request.request, None, model)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            routed = await self.routing.route(parsed)
        except NoRoute as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        d = routed.decision
        return admin_pb2.ExplainRouteResponse(
            policy=self.routing.config.policy.value,
            prompt_tokens=len(parsed.prompt_token_ids),
            block_hashes=[h.hex() for h in parsed.block_hashes.primary],
            decode_node=d.decode.node_id,
            prefill_node=d.prefill.node_id if d.prefill else "",
            local_prefill_reason=d.local_prefill_reason,
            nodes=[
                admin_pb2.NodeScore(
                    node_id=sc.node_id,
                    role=sc.role.value,
                    hit_blocks=sc.hit_blocks,
                    host_hit_blocks=sc.host_hit_blocks,
                    cost=sc.cost,
                    excluded=sc.excluded,
                    terms=sc.terms,
                )
                for sc in d.scores
            ],
        )

    async def FlushCache(self, request, context):
        _, node = await self._node(request.node_id, context)
        stub = internal_pb2_grpc.NodeControlStub(self.channel(node.address))
        try:
            resp = await stub.FlushCache(
                internal_pb2.NodeFlushRequest(), timeout=context.time_remaining() or 30
            )
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), f"{node.node_id}: {e.details()}")
        return admin_pb2.FlushCacheResponse(blocks_flushed=resp.blocks_flushed)

    async def ListLoRAAdapters(self, request, context):
        try:
            return admin_pb2.ListLoRAAdaptersResponse(adapters=await self.lora.list())
        except LoRAUpdateFailed as e:
            await context.abort(e.code, str(e))

    async def LoadLoRAAdapter(self, request, context):
        try:
            adapter = await self.lora.load(request.lora_name, request.lora_path)
        except LoRAUpdateFailed as e:
            await context.abort(e.code, str(e))
        return admin_pb2.LoRAAdapterResponse(adapter=adapter)

    async def UnloadLoRAAdapter(self, request, context):
        try:
            adapter, in_flight = await self.lora.unload(request.lora_name)
        except LoRAUpdateFailed as e:
            await context.abort(e.code, str(e))
        return admin_pb2.LoRAAdapterResponse(adapter=adapter, requests_in_flight=in_flight)


def node_to_proto(
    n: NodeInfo, cached_blocks: tuple[int, int], server_now_ms: int
) -> admin_pb2.NodeInfo:
    """``cached_blocks``: the hashes it published (device pool, host tier);
    ``server_now_ms``: the Redis server's clock, which stamped ``n.seen_ms``."""
    return admin_pb2.NodeInfo(
        node_id=n.node_id,
        role=n.role.value,
        address=n.address,
        kv_blocks_total=n.kv_blocks_total,
        kv_blocks_free=n.kv_blocks_free,
        running=n.running,
        waiting=n.waiting,
        queued_prefill_tokens=n.queued_prefill_tokens,
        cached_blocks=cached_blocks[0],
        host_kv_blocks_total=n.host_kv_blocks_total,
        host_kv_blocks_free=n.host_kv_blocks_free,
        host_cached_blocks=cached_blocks[1],
        draining=n.draining,
        heartbeat_age_ms=max(0, server_now_ms - n.seen_ms),
        requests_total=n.requests_total,
        preemptions=n.preemptions,
        computed_tokens_total=n.computed_tokens,
        generated_tokens_total=n.generated_tokens,
        tensor_parallel_size=n.tensor_parallel_size,
        num_gpus=n.num_gpus,
        model_family=n.model_family,
        weight_dtype=n.weight_dtype,
        kv_cache_dtype=n.kv_cache_dtype,
    )


def latency(values) -> admin_pb2.LatencySummary:
    s = summarize(values)
    if not s.count:
        return admin_pb2.LatencySummary()
    return admin_pb2.LatencySummary(
        count=s.count, mean_ms=s.mean, p50_ms=s.p50, p90_ms=s.p90, p99_ms=s.p99
    )


def counts(counter) -> list[admin_pb2.NodeCount]:
    return [admin_pb2.NodeCount(node_id=k, count=v) for k, v in sorted(counter.items())]
