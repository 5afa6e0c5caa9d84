"""gRPC edge of the prefill node: request in, PrefillWorker, response out; one
Prefill per call, or many over a decode node's PrefillSession."""

from __future__ import annotations

import time

import grpc

from common.grpc_server import abort_from_exception
from prefill_node import session
from prefill_node.worker import PrefillWorker
from proto import internal_pb2, internal_pb2_grpc


class PrefillNodeServicer(internal_pb2_grpc.PrefillNodeServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(
        self, request: internal_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ):
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            return await self.worker.prefill(request, deadline)
        except Exception as e:
            await abort_from_exception(context, e)

    async def PrefillSession(self, request_iterator, context: grpc.aio.ServicerContext):
        async for batch in session.PrefillSession(self.worker).run(request_iterator):
            yield batch
