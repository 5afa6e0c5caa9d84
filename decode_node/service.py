"""gRPC edge of the decode node: the routers' DecodeSessions (decode_node/session.py)."""

from __future__ import annotations

import grpc

from decode_node import session
from decode_node.worker import DecodeWorker
from proto import internal_pb2_grpc


class DecodeNodeServicer(internal_pb2_grpc.DecodeNodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def DecodeSession(self, request_iterator, context: grpc.aio.ServicerContext):
        await session.DecodeSession.check_version(context, f"decode node {self.worker.node_id}")
        async for batch in session.DecodeSession(self.worker).run(request_iterator):
            yield batch
