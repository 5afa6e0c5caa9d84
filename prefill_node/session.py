"""The serving end of PrefillSession: many Prefills over one long-lived call
(common/sessions/server.py has the machinery, common/sessions/prefill.py the
calling end).

A router keeps one per prefill node for the Prefills it sends; a decode node
one for the blocks it reserves for them (``blocks`` commands), which the
node's ``DestinationBoard`` matches to their Prefills whichever session
brought either (prefill_node/destinations.py). Each Prefill runs as its own
task, ``PrefillWorker.prefill``; its reply and then its end go into the
session's outbox.

Why a session: a message on an open call costs both ends' event loops a
fraction of a new call, and the Prefill's leg is on every disaggregated
request's time to first token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from common.sessions.server import RequestSession
from prefill_node.destinations import PendingDestination
from prefill_node.worker import PrefillWorker
from proto import internal_pb2


class PrefillSession(RequestSession):
    batch_type = internal_pb2.PrefillSessionBatch

    def __init__(self, worker: PrefillWorker) -> None:
        super().__init__()
        self.worker = worker
        self._pending: dict[str, PendingDestination] = {}  # this session's Prefills

    def _start(self, start: internal_pb2.PrefillSessionStart) -> asyncio.Task | None:
        request = start.request
        rid = request.request_id
        # The task first runs in a later turn of the loop, once this is set.
        task = super()._start(start)
        if task is None:
            return None  # refused (a repeated id): the running one keeps its own
        pending = self._pending[rid] = self.worker.pending_destination(request)
        board = self.worker.board
        board.open(rid, pending)

        def ended(_: asyncio.Task) -> None:
            # Also when the task was cancelled before it ran (no finally of its own).
            board.close(rid, pending)
            if self._pending.get(rid) is pending:
                del self._pending[rid]

        task.add_done_callback(ended)
        return task

    def other_command(self, which: str, command: internal_pb2.PrefillSessionCommand) -> None:
        if which == "blocks":
            # Any session's Prefill. One that ended meanwhile sent its end header
            # regardless, or has the board send it (destinations.py).
            self.worker.board.blocks(command.blocks)

    async def handle(
        self, request: internal_pb2.PrefillRequest, deadline: float | None
    ) -> AsyncIterator[internal_pb2.PrefillSessionEvent]:
        pending = self._pending[request.request_id]
        response = await self.worker.prefill(request, deadline, pending)
        yield internal_pb2.PrefillSessionEvent(request_id=request.request_id, response=response)

    def end_event(self, rid: str, code: grpc.StatusCode, details: str):
        return internal_pb2.PrefillSessionEvent(
            request_id=rid, end=internal_pb2.SessionEnd(code=code.value[0], details=details)
        )
