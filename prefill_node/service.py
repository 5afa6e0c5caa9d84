"""gRPC edge of the prefill node: its PrefillSessions (prefill_node/session.py)."""

from __future__ import annotations

import grpc

from prefill_node import session
from prefill_node.worker import PrefillWorker
from proto import internal_pb2_grpc


class PrefillNodeServicer(internal_pb2_grpc.PrefillNodeServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def PrefillSession(self, request_iterator, context: grpc.aio.ServicerContext):
        await session.PrefillSession.check_version(context, f"prefill node {self.worker.node_id}")
        async for batch in session.PrefillSession(self.worker).run(request_iterator):
            yield batch
