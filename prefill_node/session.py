"""A decode node's PrefillSession on a prefill node: many Prefills over one call.

Life of a session: a decode node opens one PrefillSession per prefill node it
uses and keeps it (decode_node/prefill_session.py is that end;
common/request_session.py the machinery shared with DecodeSession). Each
Prefill comes as a ``start`` command and runs here as its own task, the very
``PrefillWorker.prefill`` a Prefill call runs; its reply and then its end
(OK) go into the session's outbox, or only an end with the status its Prefill
call would have failed with. A ``cancel`` command aborts one Prefill (freeing
its blocks), as cancelling its call would; the call ending aborts them all.

Why: a Prefill call's two legs are on every disaggregated request's time to
first token, and a message each way on an open call costs both nodes' loops
less than a new unary call (docs/performance.md, "The Prefill hop").
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from common.request_session import RequestSession
from prefill_node.worker import PrefillWorker
from proto import internal_pb2


class PrefillSession(RequestSession):
    batch_type = internal_pb2.PrefillSessionBatch

    def __init__(self, worker: PrefillWorker) -> None:
        super().__init__()
        self.worker = worker

    async def handle(
        self, request: internal_pb2.PrefillRequest, deadline: float | None
    ) -> AsyncIterator[internal_pb2.PrefillSessionEvent]:
        response = await self.worker.prefill(request, deadline)
        yield internal_pb2.PrefillSessionEvent(request_id=request.request_id, response=response)

    def end_event(self, rid: str, code: grpc.StatusCode, details: str):
        return internal_pb2.PrefillSessionEvent(
            request_id=rid, end=internal_pb2.SessionEnd(code=code.value[0], details=details)
        )
