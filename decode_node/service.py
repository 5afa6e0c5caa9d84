"""gRPC edge of the decode node: DecodeRequest in, DecodeWorker, GenerateResponse stream out."""

from __future__ import annotations

import time

import grpc

from common.grpc_server import abort_from_exception
from decode_node.worker import DecodeWorker, NoCapacity
from proto import internal_pb2, internal_pb2_grpc


class DecodeNodeServicer(internal_pb2_grpc.DecodeNodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Decode(self, request: internal_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            async for response in self.worker.decode(request, deadline):
                yield response
        except NoCapacity as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except Exception as e:
            await abort_from_exception(context, e)
