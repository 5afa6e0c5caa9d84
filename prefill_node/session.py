"""A decode node's PrefillSession on a prefill node: many Prefills over one call.

Life of a session: a decode node opens one PrefillSession per prefill node it
uses and keeps it (common/sessions/prefill.py is that end;
common/sessions/server.py the machinery shared with DecodeSession). Each
Prefill comes as a ``start`` command and runs here as its own task, the very
``PrefillWorker.prefill`` a Prefill call runs; its reply and then its end
(OK) go into the session's outbox, or only an end with the status its Prefill
call would have failed with. A ``cancel`` command aborts one Prefill (freeing
its blocks), as cancelling its call would; the call ending aborts them all.
A Prefill started with ``blocks_follow`` (which the session's first batch
offers) computes at once; its ``blocks`` command, the decode node's
reservation, comes after and is handed to its transfer
(prefill_node/late_blocks.py). A router's session brings Prefills it sent
beside its request to the decode node (``dispatched``): their blocks come on
that decode node's own session, so blocks are matched node-wide
(``PrefillWorker.board``).

Why: a Prefill call's two legs are on every disaggregated request's time to
first token, and a message each way on an open call costs both nodes' loops
less than a new unary call (docs/performance.md, "The Prefill hop").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from common.sessions.server import RequestSession
from prefill_node.late_blocks import LateBlocks
from prefill_node.worker import PrefillWorker
from proto import internal_pb2


class PrefillSession(RequestSession):
    batch_type = internal_pb2.PrefillSessionBatch

    def __init__(self, worker: PrefillWorker) -> None:
        super().__init__()
        self.worker = worker
        self._late: dict[str, LateBlocks] = {}  # this session's Prefills whose blocks follow

    def hello(self) -> internal_pb2.PrefillSessionBatch:
        return internal_pb2.PrefillSessionBatch(
            blocks_follow=True, dispatched=self.worker.takes_dispatched, header_block=True
        )

    def _start(self, start: internal_pb2.PrefillSessionStart) -> asyncio.Task | None:
        task = super()._start(start)
        request = start.request
        if task is None or not request.blocks_follow:
            return task
        rid = request.request_id
        late = self._late[rid] = self.worker.late_blocks(request)
        board = self.worker.board
        board.open(rid, late)

        def ended(_: asyncio.Task) -> None:
            # Also when the task was cancelled before it ran (no finally of its own).
            board.close(rid, late)
            if self._late.get(rid) is late:
                del self._late[rid]

        task.add_done_callback(ended)
        return task

    def other_command(self, which: str, command: internal_pb2.PrefillSessionCommand) -> None:
        if which == "blocks":
            # Any session's Prefill (a router's, dispatched). One that ended
            # meanwhile sent its end header regardless, or, a router's, has the
            # board send it (late_blocks.py).
            self.worker.board.blocks(command.blocks)

    async def handle(
        self, request: internal_pb2.PrefillRequest, deadline: float | None
    ) -> AsyncIterator[internal_pb2.PrefillSessionEvent]:
        late = self._late.get(request.request_id) if request.blocks_follow else None
        response = await self.worker.prefill(request, deadline, late)
        yield internal_pb2.PrefillSessionEvent(request_id=request.request_id, response=response)

    def end_event(self, rid: str, code: grpc.StatusCode, details: str):
        return internal_pb2.PrefillSessionEvent(
            request_id=rid, end=internal_pb2.SessionEnd(code=code.value[0], details=details)
        )
