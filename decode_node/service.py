"""gRPC edge of the decode node: DecodeRequest in, DecodeWorker, GenerateResponse stream out."""

from __future__ import annotations

import time

import grpc

from common.grpc_server import abort_from_exception
from common.reliability import FAILED_NODE_KEY
from decode_node.worker import DecodeWorker, PrefillFailed
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
        except PrefillFailed as e:
            # Nothing reached the client: the router retries on another prefill
            # node, avoiding the one named here.
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if e.code is grpc.StatusCode.RESOURCE_EXHAUSTED
                else grpc.StatusCode.UNAVAILABLE
            )
            context.set_trailing_metadata(((FAILED_NODE_KEY, e.node_id),))
            await context.abort(code, str(e))
        except Exception as e:
            await abort_from_exception(context, e)
