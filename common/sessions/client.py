"""The calling end of a session: one long-lived bidi call to a node, every request a
message on it (common/sessions/server.py is the serving end).

A router keeps one DecodeSession per decode node (router/node_session.py), a
decode node one PrefillSession per prefill node (common/sessions/prefill.py).
This is what they share: opening the call once for every request that asks
meanwhile, and only after the node's first batch (which names its protocol
version: common/version.py; another version fails the opening with
FAILED_PRECONDITION, naming both); bounded writes, one at a time; ``cancel``
commands; one reader task that hands each event to its request; and when the
call ends under its requests (the node died, restarted or stopped),
UNAVAILABLE for each of them, the next request opening a new session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from common.version import PROTOCOL_VERSION, VERSION_KEY, mismatch

logger = logging.getLogger(__name__)

# The metadata every session call is opened with (common/version.py).
VERSION_METADATA = ((VERSION_KEY, str(PROTOCOL_VERSION)),)

# A command the node does not take within this long (gRPC's flow-control window
# full: the node stopped reading), or a session it does not open within it,
# drops the session: its requests fail with UNAVAILABLE, which their callers
# retry elsewhere.
WRITE_TIMEOUT_S = 2.0

OK_CODE = grpc.StatusCode.OK.value[0]
CODES = {code.value[0]: code for code in grpc.StatusCode}


class SessionClient:
    """One node's session, opened on first use and reopened after a loss. One event loop only.

    Subclasses name the node kind (``kind``), open the call (``_new_call``), write a cancel (``_cancel_command``)
    and take the node's events (``_on_event``) and the loss of every request
    still waiting (``_fail_all``)."""

    kind = "node"  # in messages: "decode node", "prefill node"

    def __init__(self, node_id: str, on_lost: Callable[[], None] | None = None) -> None:
        self.node_id = node_id
        # Called when an open session ends (the node died, restarted or
        # stopped, or took no command in time): the caller's other state with
        # that node may be as stale (a decode node's KV channels from it).
        self.on_lost = on_lost
        self._call = None
        self._reader: asyncio.Future | None = None
        self._opening: asyncio.Future | None = None
        self._open_error: grpc.aio.AioRpcError | None = None  # why the last open failed
        self._write_lock = asyncio.Lock()  # grpc.aio takes one write at a time on a call
        self._writes: set[asyncio.Future] = set()  # commands being written, held until written
        self._why = "its session was cancelled"  # what a cancelled session's requests are told

    # ----------------------------------------------------- for subclasses
    def _new_call(self):
        """The session call, opened with ``VERSION_METADATA``."""
        raise NotImplementedError

    def _cancel_command(self, rid: str):
        raise NotImplementedError

    def _on_event(self, event) -> None:
        raise NotImplementedError

    def _fail_all(self, error: grpc.aio.AioRpcError) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ the call
    async def close(self) -> None:
        self._why = "the caller closed its session"
        if self._opening is not None:
            self._opening.cancel()
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    @property
    def is_open(self) -> bool:
        """A session is open now (what its node said of itself holds)."""
        return self._call is not None

    async def open(self) -> None:
        """Open the session now if it is not: what the node says of itself (its
        first batch) is known once it returns. Raises what a request would get."""
        await self._opened()

    async def _opened(self) -> None:
        """Open the session first if need be; raises the request's error (as a
        grpc.aio.AioRpcError) when the node did not answer or speaks another
        protocol version."""
        if self._call is None:
            await self._open()
        if self._call is None:
            raise self._open_error or self.lost("no session")

    async def _open(self) -> None:
        """Open a session, once for every request that asks meanwhile."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._handshake())
            self._opening.add_done_callback(lambda _: setattr(self, "_opening", None))
        await asyncio.shield(self._opening)

    async def _handshake(self) -> None:
        # Nothing is written before the node's first batch: a command written
        # while the node refuses the call turns the call's status into the
        # transport's INTERNAL and hides the refusal (another protocol version).
        call = self._new_call()
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                hello = await call.read()
        except TimeoutError:
            call.cancel()
            self._open_error = self.lost("did not open a session in time")
            return
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.FAILED_PRECONDITION:
                self._open_error = status_error(e.code(), e.details() or "refused the session")
                logger.error("%s %s refused the session: %s", self.kind, self.node_id, e.details())
                return
            self._open_error = self.lost(e.details() or e.code().name)
            return
        if hello is grpc.aio.EOF:
            self._open_error = self.lost("ended its session at once")
            return
        why = mismatch(PROTOCOL_VERSION, hello.protocol_version, f"{self.kind} {self.node_id}")
        if why is not None:
            call.cancel()
            logger.error("%s", why)
            self._open_error = status_error(grpc.StatusCode.FAILED_PRECONDITION, why)
            return
        self._open_error = None
        self._why = "its session was cancelled"
        self._call = call
        self._reader = asyncio.ensure_future(self._read(call))

    async def _send(self, command) -> None:
        """Write ``command`` in a task of its own and wait for it. grpc.aio cancels
        the whole call when a write is cancelled half-way, so a request given up
        on (its client left, its deadline passed) while its command is being
        written must not cancel the write: the session's other requests would
        fail with it. A cancel command for it follows in order."""
        await asyncio.shield(self._write_soon(command))

    def _write_soon(self, command) -> asyncio.Future:
        """``_write(command)`` as a task, held until written (the loop keeps weak
        references only)."""
        task = asyncio.ensure_future(self._write(command))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    async def _write(self, command) -> None:
        session = self._call
        if session is None:  # lost meanwhile: its reader failed the requests
            return
        try:
            # Bounded: a stalled node stops taking writes once gRPC's flow-control
            # window is full, and a request must not wait on it with no end.
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                async with self._write_lock:
                    await session.write(command)
        except TimeoutError:
            logger.warning(
                "%s %s took no command for %.0f s: its session is dropped",
                self.kind,
                self.node_id,
                WRITE_TIMEOUT_S,
            )
            self._why = f"took no command for {WRITE_TIMEOUT_S:.0f} s"
            session.cancel()  # its reader fails every request on it, this one too
        except Exception as e:  # the session ended under us: its reader fails the requests
            logger.debug("%s %s: a write on its session failed: %s", self.kind, self.node_id, e)

    def _send_cancel(self, rid: str) -> None:
        if self._call is None:
            return  # the session is gone, and with it the request on the node
        self._write_soon(self._cancel_command(rid))

    async def _read(self, session) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            while (batch := await session.read()) is not grpc.aio.EOF:
                for event in batch.events:
                    self._on_event(event)
            error = self.lost("ended the session")
        except grpc.aio.AioRpcError as e:
            error = self.lost(e.details() or e.code().name)
        except asyncio.CancelledError:
            error = self.lost(self._why)
            raise
        finally:
            if self._call is session:
                self._call = None
            session.cancel()  # a no-op once it ended; else (a failure here) the node lets go too
            self._fail_all(error or self.lost(self._why))
            if self.on_lost is not None:
                self.on_lost()

    def lost(self, why: str) -> grpc.aio.AioRpcError:
        """UNAVAILABLE, as the transport would have said to each request's own call."""
        return status_error(grpc.StatusCode.UNAVAILABLE, f"{self.kind} {self.node_id}: {why}")


def status_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> grpc.aio.AioRpcError:
    """The error a call that ended with this status would raise."""
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )
