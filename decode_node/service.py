"""gRPC edge of the decode node: DecodeRequest in, DecodeWorker, GenerateResponse stream
out; one request per Decode call, or many over a router's DecodeSession."""

from __future__ import annotations

import time

import grpc

from common.grpc_server import abort_from_exception
from common.runtime.reliability import FAILED_NODE_KEY
from decode_node import session
from decode_node.prefill_call import PrefillFailed
from decode_node.worker import DecodeWorker
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
            context.set_trailing_metadata(((FAILED_NODE_KEY, e.node_id),))
            await context.abort(e.status_code, str(e))
        except Exception as e:
            await abort_from_exception(context, e)

    async def DecodeSession(self, request_iterator, context: grpc.aio.ServicerContext):
        async for batch in session.DecodeSession(self.worker).run(request_iterator):
            yield batch
