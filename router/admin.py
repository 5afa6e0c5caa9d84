"""The Admin service (own port): cluster views for operators and pdctl."""

from __future__ import annotations

import grpc

from common.cluster import Cluster, now_ms
from proto import admin_pb2, admin_pb2_grpc


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def ListNodes(
        self, request: admin_pb2.ListNodesRequest, context: grpc.aio.ServicerContext
    ):
        try:
            nodes = await self.cluster.nodes()
            counts = await self.cluster.block_counts([n.node_id for n in nodes])
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster state is unavailable: {e}")
        now = now_ms()
        return admin_pb2.ListNodesResponse(
            nodes=[
                admin_pb2.NodeInfo(
                    node_id=n.node_id,
                    role=n.role.value,
                    address=n.address,
                    kv_blocks_total=n.kv_blocks_total,
                    kv_blocks_free=n.kv_blocks_free,
                    running=n.running,
                    waiting=n.waiting,
                    queued_prefill_tokens=n.queued_prefill_tokens,
                    cached_blocks=counts.get(n.node_id, 0),
                    draining=n.draining,
                    heartbeat_age_ms=max(0, now - n.updated_ms),
                )
                for n in sorted(nodes, key=lambda n: n.node_id)
            ]
        )
