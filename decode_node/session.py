"""A router's DecodeSession on a decode node: many requests over one call.

Life of a session: a router opens one DecodeSession per decode node and keeps
it (common/sessions/server.py has the machinery). Each request comes as a
``start`` command and runs here as its own task, the very
``DecodeWorker.decode``; what it yields goes into the session's outbox. The engine thread hands a
step's outputs over together, every request's task turns its output into
messages in that same loop turn, and so one engine step becomes one message to
the router instead of one per request. A request ends with an ``end`` event
carrying its status (and the failed prefill node's id, where that is why).

Why: per token, the session does the gRPC work once per step instead of once
per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.sessions.server import RequestSession
from decode_node.remote_prefill import PrefillFailed
from decode_node.worker import DecodeWorker
from proto import internal_pb2


class DecodeSession(RequestSession):
    batch_type = internal_pb2.SessionBatch

    def __init__(self, worker: DecodeWorker) -> None:
        super().__init__()
        self.worker = worker

    async def handle(
        self, request: internal_pb2.DecodeRequest, deadline: float | None
    ) -> AsyncIterator[internal_pb2.SessionEvent]:
        rid = request.request_id
        async for response in self.worker.decode(request, deadline):
            yield internal_pb2.SessionEvent(request_id=rid, response=response)

    def end_event(self, rid: str, code: grpc.StatusCode, details: str, failed_node: str = ""):
        return internal_pb2.SessionEvent(
            request_id=rid,
            end=internal_pb2.SessionEnd(
                code=code.value[0], details=details, failed_node=failed_node
            ),
        )

    def failure_event(self, rid: str, error: Exception):
        if isinstance(error, PrefillFailed):
            # Nothing reached the client: the router retries on another prefill
            # node, avoiding the one named here.
            return self.end_event(rid, error.status_code, str(error), error.node_id)
        return super().failure_event(rid, error)
