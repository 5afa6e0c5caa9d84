"""The reserved blocks of a Prefill that started before its decode node reserved them.

A decode node on a PrefillSession sends a Prefill first and reserves the
prompt's blocks after (``PrefillRequest.blocks_follow``); the reservation's
first block and size follow as a ``blocks`` command. The prompt computes
meanwhile, and the KV streamer (prefill_node/kv_stream.py) sends none of it
before they came: on a GPU it needs them only at the step's first due chunk
(with the first layers held, the held chunk's last layer), which the host
reaches milliseconds after the blocks came; on a CPU, or with tensor
parallelism (the other ranks learn a step's segments before its launch), it
waits for them before the step's launch.

Why: the decode node's reservation (its prefix lookup and the allocation of a
prompt's blocks, 0.6 ms for 2048 tokens) was on every disaggregated request's
time to first token, before the prefill node heard of the request.

A router may send the Prefill itself (``PrefillRequest.dispatched``), at the
same time as its request to the decode node: the decode node's blocks then come
on that node's own session, before or after the router's Prefill, with the
decode node's channel epoch, which must be the one this node's Prefill uses
(``LateBoard``). Why: the decode node's admission and the Prefill's leg from
it (about 1 ms on the GPU host) were on every disaggregated first token.

Set on the event loop's thread (``set``, ``fail``), waited for on the engine
thread (``wait``); the event orders the fields' writes before their reads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from common.kv_transfer.channel import TransferError
from common.kv_transfer.ticket import Destination
from common.runtime.reliability import StaleChannel
from proto import internal_pb2

# How long the engine thread waits for a step's late blocks at most (all of
# them). A decode node sends a Prefill before its reservation only while its
# engine thread is idle, so the reservation runs at once, right after the
# Prefill's write (no room fails the request, and the Prefill with it): a
# wait this long means the decode node is stuck, and the transfers fail
# rather than stall every other prompt on this node.
WAIT_S = 2.0


def check_blocks(first_block: int, num_blocks: int, num_tokens: int, block_size: int) -> None:
    """A decode node's reservation against a prompt of ``num_tokens`` here
    (ValueError when it does not fit: a bad request)."""
    num_prompt_blocks = -(-num_tokens // block_size)
    if num_blocks != num_prompt_blocks:
        raise ValueError(
            f"the decode node reserved {num_blocks} blocks, the prompt has "
            f"{num_prompt_blocks} of {block_size} tokens: are both nodes on the same "
            "model and block size?"
        )
    if first_block >= num_blocks:
        raise ValueError(f"first_block {first_block} leaves nothing of {num_blocks} blocks to send")


class LateBlocks:
    __slots__ = (
        "_event",
        "block_size",
        "error",
        "first_block",
        "num_blocks",
        "num_tokens",
        "reservation_id",
        "target",
    )

    def __init__(
        self,
        num_tokens: int,
        block_size: int,
        target: Destination | None = None,
        reservation_id: int = 0,
    ) -> None:
        self.num_tokens, self.block_size = num_tokens, block_size  # the prompt here
        # A dispatched Prefill's: the channel it sends on (resolved once, when
        # it came) and its reservation id, which its blocks must name. None:
        # the decode node's own Prefill, whose blocks are not checked so.
        self.target, self.reservation_id = target, reservation_id
        self.first_block = 0
        self.num_blocks = 0
        self.error: Exception | None = None
        self._event = threading.Event()

    @property
    def came(self) -> bool:
        """The blocks came and fit (the decode node expects this stream)."""
        return self._event.is_set() and self.error is None

    @property
    def ready(self) -> bool:
        """The blocks came, or the wait for them is over."""
        return self._event.is_set()

    def set(self, first_block: int, num_blocks: int, epoch: int | None = None) -> None:
        """The decode node's reservation; one that does not fit the prompt fails
        it, and so does an ``epoch`` other than a dispatched Prefill's channel's."""
        if self._event.is_set():
            return  # a repeat, or too late (the Prefill ended)
        if self.target is not None and epoch != self.target.epoch:
            # The decode node's channel with this node is not the one this
            # Prefill would send on (it failed or restarted since): nothing sent
            # there would land. The router retries with the decode node's Prefill.
            self.fail(
                StaleChannel(
                    f"the decode node's KV channel (epoch {epoch}) is not this node's "
                    f"(epoch {self.target.epoch}): it moved on"
                )
            )
            return
        try:
            check_blocks(first_block, num_blocks, self.num_tokens, self.block_size)
        except ValueError as e:
            self.fail(e)
            return
        self.first_block, self.num_blocks = first_block, num_blocks
        self._event.set()

    def fail(self, error: Exception) -> None:
        """No blocks will come (the Prefill ended, or they did not fit)."""
        if not self._event.is_set():
            self.error = error
            self._event.set()

    def end(self) -> None:
        """Its Prefill ended: no blocks are awaited any more (wakes a wait)."""
        self.fail(TransferError("the Prefill ended before the decode node's blocks came"))

    def wait(self, timeout_s: float) -> tuple[int, int]:
        """(first_block, num_blocks); raises TransferError when none came in time
        or the Prefill ended first, ValueError when they did not fit."""
        if not self._event.wait(timeout_s):
            raise TransferError(
                f"the decode node sent no blocks for this Prefill within {timeout_s:g} s"
            )
        if self.error is not None:
            raise self.error
        return self.first_block, self.num_blocks


class LateBoard:
    """The node's running Prefills whose blocks follow, by request id, whichever
    session brought them; and the blocks of dispatched Prefills (they carry the
    decode node's channel, ``PrefillBlocks.destination``) that came first (the
    decode node's session was quicker than the router's), kept for ``WAIT_S``.

    The decode node expects a dispatched Prefill's stream from when it sent its
    blocks, so that stream ends with an end header on the channel the blocks
    name whatever becomes of the Prefill: the Prefill sends it where its blocks
    came and fit (``LateBlocks.came``); the board hands it to ``orphaned``
    (decode node's destination, reservation id) where they did not (another
    channel, a Prefill that failed or ended, one that never came). Event loop's
    thread only."""

    def __init__(self, orphaned: Callable[[internal_pb2.KVDestination], None]) -> None:
        self._orphaned = orphaned
        self._late: dict[str, LateBlocks] = {}
        # request_id -> blocks that came before their Prefill, and their timer
        self._early: dict[str, tuple[internal_pb2.PrefillBlocks, asyncio.TimerHandle]] = {}

    def open(self, request_id: str, late: LateBlocks) -> None:
        """A Prefill whose blocks follow started; blocks that came first are its."""
        self._late[request_id] = late
        early = self._early.pop(request_id, None)
        if early is not None:
            early[1].cancel()
            self._give(late, early[0])

    def close(self, request_id: str, late: LateBlocks) -> None:
        """It ended (wakes a wait for its blocks)."""
        late.end()
        if self._late.get(request_id) is late:
            del self._late[request_id]

    def blocks(self, blocks: internal_pb2.PrefillBlocks) -> None:
        """A decode node's ``blocks`` command, on any session."""
        late = self._late.get(blocks.request_id)
        if late is not None:
            self._give(late, blocks)
        elif blocks.HasField("destination"):
            # A dispatched Prefill's, ahead of it or after it ended. A decode
            # node's own Prefill always comes first on its session, so its
            # blocks are never kept (another Prefill of the id must not get them).
            rid = blocks.request_id
            if (old := self._early.pop(rid, None)) is not None:
                old[1].cancel()
                self._orphaned(old[0].destination)
            timer = asyncio.get_running_loop().call_later(WAIT_S, self._expire, rid)
            self._early[rid] = (blocks, timer)

    def _expire(self, request_id: str) -> None:
        early = self._early.pop(request_id, None)
        if early is not None:
            self._orphaned(early[0].destination)  # its Prefill never came

    def _give(self, late: LateBlocks, blocks: internal_pb2.PrefillBlocks) -> None:
        dispatched = blocks.HasField("destination")
        if not dispatched:
            late.set(blocks.first_block, blocks.num_blocks)
            return
        dest = blocks.destination
        if late.ready:
            if not late.came:  # it failed or ended: its stream ends here
                self._orphaned(dest)
            return  # else a repeat
        if late.target is None or dest.reservation_id != late.reservation_id:
            late.fail(
                ValueError(
                    f"the decode node's blocks name reservation {dest.reservation_id}, "
                    f"the Prefill {late.reservation_id}"
                )
            )
        else:
            late.set(blocks.first_block, blocks.num_blocks, dest.channel_epoch)
        if not late.came:
            self._orphaned(dest)
