"""Where a Prefill's KV goes: the decode node's reserved blocks and KV channel,
which come on the decode node's own PrefillSession, beside the router's Prefill.

The router sends a request's Prefill here and the request to its decode node at
the same time; the decode node reserves the prompt's blocks and sends them,
with its KV channel (store, epoch, size), as a ``blocks`` command. Either may
come first. The prompt computes meanwhile, and the KV streamer
(prefill_node/kv_stream.py) sends none of it before the blocks came: on a GPU
it needs them only at the step's first due chunk, which the host reaches
after the step's first layers; on a CPU, or with tensor parallelism (the
other ranks learn a step's segments before its launch), before the step's
launch. A decode node reserves as soon as its engine thread is between steps,
so the wait is short, and nothing else waits for it.

The decode node expects the reservation's stream from when it sent its
blocks, so that stream ends with an end header on the channel the blocks name,
whatever becomes of the Prefill: the Prefill sends it where its blocks came and
fit (``PendingDestination.came``); the board hands it to ``orphaned`` where they
did not (a Prefill that failed, ended or never came, blocks that did not fit).

``set`` and ``fail`` run on the event loop's thread, ``wait`` on the engine
thread; the event orders the fields' writes before their reads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from common.kv_transfer.channel import TransferError
from common.kv_transfer.ticket import Destination
from proto import internal_pb2

# How long the engine thread waits for a step's blocks at most (all of them),
# and how long blocks that came before their Prefill are kept. A decode node
# reserves between two of its steps, so a wait this long means it is stuck:
# the transfers fail rather than stall every other prompt on this node.
WAIT_S = 2.0


def check_blocks(first_block: int, num_blocks: int, num_tokens: int, block_size: int) -> None:
    """A decode node's reservation against a prompt of ``num_tokens`` here
    (ValueError when it does not fit)."""
    num_prompt_blocks = -(-num_tokens // block_size)
    if num_blocks != num_prompt_blocks:
        raise ValueError(
            f"the decode node reserved {num_blocks} blocks, the prompt has "
            f"{num_prompt_blocks} of {block_size} tokens: are both nodes on the same "
            "model and block size?"
        )
    if first_block >= num_blocks:
        raise ValueError(f"first_block {first_block} leaves nothing of {num_blocks} blocks to send")


def destination_of(channel: internal_pb2.KVChannel) -> Destination:
    return Destination(
        channel.node_id,
        channel.store_host,
        channel.store_port,
        channel.epoch,
        max(1, channel.tensor_parallel_size),
        channel.kv_cache_dtype,
    )


class PendingDestination:
    """One Prefill's destination, until (and once) the decode node's blocks came."""

    __slots__ = (
        "_event",
        "block_size",
        "decode_node_id",
        "decode_tp",
        "destination",
        "error",
        "first_block",
        "num_blocks",
        "num_tokens",
        "reservation_id",
    )

    def __init__(self, req: internal_pb2.PrefillRequest, block_size: int) -> None:
        self.num_tokens, self.block_size = len(req.prompt_token_ids), block_size
        # What the router's Prefill says of the decode node (its registration's).
        self.decode_node_id = req.decode_node_id
        self.decode_tp = max(1, req.decode_tensor_parallel_size)
        self.reservation_id = req.reservation_id
        self.destination: Destination | None = None
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

    def set(self, blocks: internal_pb2.PrefillBlocks) -> None:
        """The decode node's blocks; ones that do not fit fail the Prefill."""
        if self._event.is_set():
            return  # a repeat, or too late (the Prefill ended)
        try:
            self._check(blocks)
        except ValueError as e:
            self.fail(e)
            return
        self.destination = destination_of(blocks.channel)
        self.first_block, self.num_blocks = blocks.first_block, blocks.num_blocks
        self._event.set()

    def _check(self, blocks: internal_pb2.PrefillBlocks) -> None:
        channel = blocks.channel
        if blocks.reservation_id != self.reservation_id:
            raise ValueError(
                f"the decode node's blocks name reservation {blocks.reservation_id}, "
                f"the Prefill {self.reservation_id}"
            )
        if channel.node_id != self.decode_node_id:
            raise ValueError(
                f"blocks from decode node {channel.node_id} for a Prefill bound for "
                f"{self.decode_node_id}"
            )
        if max(1, channel.tensor_parallel_size) != self.decode_tp:
            raise ValueError(
                f"decode node {channel.node_id} has {channel.tensor_parallel_size} ranks, "
                f"the Prefill says {self.decode_tp}"
            )
        check_blocks(blocks.first_block, blocks.num_blocks, self.num_tokens, self.block_size)

    def fail(self, error: Exception) -> None:
        """No blocks will come (the Prefill ended, or they did not fit)."""
        if not self._event.is_set():
            self.error = error
            self._event.set()

    def end(self) -> None:
        """Its Prefill ended: no blocks are awaited any more (wakes a wait)."""
        self.fail(TransferError("the Prefill ended before the decode node's blocks came"))

    def wait(self, timeout_s: float) -> Destination:
        """The destination, once the blocks came; raises TransferError when none
        came in time or the Prefill ended first, ValueError when they did not fit."""
        if not self._event.wait(timeout_s):
            raise TransferError(
                f"the decode node sent no blocks for this Prefill within {timeout_s:g} s"
            )
        if self.error is not None:
            raise self.error
        return self.destination


class DestinationBoard:
    """The node's running Prefills, by request id, and the blocks that came
    before their Prefill (kept for ``WAIT_S``). Blocks come on a decode node's
    session, Prefills on a router's: the board matches them node-wide. Event
    loop's thread only."""

    def __init__(self, orphaned: Callable[[Destination, int], None]) -> None:
        # Ends a reservation's stream on a channel (the destination, its id).
        self._orphaned = orphaned
        self._pending: dict[str, PendingDestination] = {}
        # request_id -> blocks that came before their Prefill, and their timer
        self._early: dict[str, tuple[internal_pb2.PrefillBlocks, asyncio.TimerHandle]] = {}

    def open(self, request_id: str, pending: PendingDestination) -> None:
        """A Prefill started; blocks that came first are its."""
        self._pending[request_id] = pending
        early = self._early.pop(request_id, None)
        if early is not None:
            early[1].cancel()
            self._give(pending, early[0])

    def close(self, request_id: str, pending: PendingDestination) -> None:
        """It ended (wakes a wait for its blocks)."""
        pending.end()
        if self._pending.get(request_id) is pending:
            del self._pending[request_id]

    def blocks(self, blocks: internal_pb2.PrefillBlocks) -> None:
        """A decode node's ``blocks`` command, on any session."""
        pending = self._pending.get(blocks.request_id)
        if pending is not None:
            self._give(pending, blocks)
            return
        # Ahead of its Prefill, or after it ended.
        rid = blocks.request_id
        if (old := self._early.pop(rid, None)) is not None:
            old[1].cancel()
            self._end_stream(old[0])
        timer = asyncio.get_running_loop().call_later(WAIT_S, self._expire, rid)
        self._early[rid] = (blocks, timer)

    def _expire(self, request_id: str) -> None:
        early = self._early.pop(request_id, None)
        if early is not None:
            self._end_stream(early[0])  # its Prefill never came

    def _give(self, pending: PendingDestination, blocks: internal_pb2.PrefillBlocks) -> None:
        if pending.ready:
            if not pending.came:  # it failed or ended: its stream ends here
                self._end_stream(blocks)
            return  # else a repeat
        pending.set(blocks)
        if not pending.came:
            self._end_stream(blocks)

    def _end_stream(self, blocks: internal_pb2.PrefillBlocks) -> None:
        self._orphaned(destination_of(blocks.channel), blocks.reservation_id)
