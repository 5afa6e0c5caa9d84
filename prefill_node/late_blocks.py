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

Set on the event loop's thread (``set``, ``fail``), waited for on the engine
thread (``wait``); the event orders the fields' writes before their reads.
"""

from __future__ import annotations

import threading

from common.kv_transfer.channel import TransferError

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
    __slots__ = ("_event", "block_size", "error", "first_block", "num_blocks", "num_tokens")

    def __init__(self, num_tokens: int, block_size: int) -> None:
        self.num_tokens, self.block_size = num_tokens, block_size  # the prompt here
        self.first_block = 0
        self.num_blocks = 0
        self.error: Exception | None = None
        self._event = threading.Event()

    @property
    def ready(self) -> bool:
        """The blocks came, or the wait for them is over."""
        return self._event.is_set()

    def set(self, first_block: int, num_blocks: int) -> None:
        """The decode node's reservation; one that does not fit the prompt fails it."""
        if self._event.is_set():
            return  # a repeat, or too late (the Prefill ended)
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
