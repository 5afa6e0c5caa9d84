"""LateBoard: a decode node's blocks matched to a Prefill whichever session
brought either (prefill_node/late_blocks.py), a router's Prefill's checks, and
the end of every stream the decode node expects: by the Prefill where its
blocks came and fit, by the board (``orphaned``) where they did not."""

from __future__ import annotations

import asyncio

import pytest

from common.kv_transfer.channel import TransferError
from common.kv_transfer.ticket import Destination
from common.runtime.reliability import StaleChannel
from prefill_node import late_blocks
from prefill_node.late_blocks import LateBlocks, LateBoard
from proto import internal_pb2

BLOCK = 16
TOKENS = 40  # 3 blocks
CHANNEL = Destination("decode-0", "127.0.0.1", 5000, 7)  # the channel a Prefill sends on


def blocks(rid="r", first=0, num=3, epoch=None, reservation_id=0):
    b = internal_pb2.PrefillBlocks(request_id=rid, first_block=first, num_blocks=num)
    if epoch is not None:  # a router's Prefill's: the decode node's channel and reservation
        d = b.destination
        d.node_id, d.store_host, d.store_port = "decode-0", "127.0.0.1", 5000
        d.channel_epoch, d.reservation_id = epoch, reservation_id
    return b


def dispatched(reservation_id=5) -> LateBlocks:
    return LateBlocks(TOKENS, BLOCK, CHANNEL, reservation_id)


def board() -> tuple[LateBoard, list[tuple[int, int]]]:
    """A board and the (epoch, reservation id) of every stream it ended."""
    ended: list[tuple[int, int]] = []
    return LateBoard(lambda d: ended.append((d.channel_epoch, d.reservation_id))), ended


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_decode_nodes_own_prefill_takes_its_blocks_unchecked():
    b, ended = board()
    late = LateBlocks(TOKENS, BLOCK)
    b.open("r", late)
    b.blocks(blocks(first=1))
    assert late.came and late.wait(0) == (1, 3)
    assert ended == []  # its Prefill ends its stream, as it always does


def test_blocks_before_a_dispatched_prefill_wait_for_it():
    async def main():
        b, ended = board()
        b.blocks(blocks(first=2, epoch=7, reservation_id=5))  # the router's came later
        late = dispatched()
        b.open("r", late)
        assert late.wait(0) == (2, 3)
        await asyncio.sleep(late_blocks.WAIT_S + 0.2)  # its timer was stopped
        assert ended == []

    run(main())


def test_a_classic_prefills_blocks_without_it_are_dropped():
    # A decode node's own Prefill comes first on its session: blocks for none
    # are of one that ended, never kept for a later Prefill of the same id.
    b, _ = board()
    b.blocks(blocks(first=2))
    late = LateBlocks(TOKENS, BLOCK)
    b.open("r", late)
    assert not late.ready


def test_another_epoch_fails_a_dispatched_prefill_and_its_stream_ends_there():
    b, ended = board()
    late = dispatched()
    b.open("r", late)
    b.blocks(blocks(epoch=8, reservation_id=5))
    assert not late.came
    with pytest.raises(StaleChannel, match="epoch 8"):
        late.wait(0)
    assert ended == [(8, 5)]  # on the decode node's channel, which expects it


def test_another_reservation_id_fails_a_dispatched_prefill():
    b, ended = board()
    late = dispatched()
    b.open("r", late)
    b.blocks(blocks(epoch=7, reservation_id=6))
    with pytest.raises(ValueError, match="reservation 6"):
        late.wait(0)
    assert ended == [(7, 6)]


def test_blocks_that_do_not_fit_the_prompt_fail_it():
    b, ended = board()
    late = dispatched()
    b.open("r", late)
    b.blocks(blocks(num=4, epoch=7, reservation_id=5))
    with pytest.raises(ValueError, match="reserved 4 blocks"):
        late.wait(0)
    assert ended == [(7, 5)]


def test_blocks_after_their_prefill_ended_end_its_stream_at_once():
    b, ended = board()
    late = dispatched()
    b.open("r", late)
    late.fail(TransferError("the Prefill ended before the decode node's blocks came"))
    b.blocks(blocks(epoch=7, reservation_id=5))  # still on the board: its end is near
    assert ended == [(7, 5)]
    b.close("r", late)
    with pytest.raises(TransferError, match="ended"):
        late.wait(0)


def test_blocks_of_a_prefill_that_never_comes_end_its_stream_after_wait_s():
    async def main():
        b, ended = board()
        b.blocks(blocks("gone", epoch=7, reservation_id=5))
        await asyncio.sleep(late_blocks.WAIT_S / 2)
        assert ended == []
        await asyncio.sleep(late_blocks.WAIT_S / 2 + 0.3)
        assert ended == [(7, 5)]
        late = dispatched()
        b.open("gone", late)  # too late: the blocks are no longer kept
        assert not late.ready

    run(main())


def test_a_dispatched_prefill_with_no_channel_here_fails_at_its_blocks():
    b, ended = board()
    late = LateBlocks(TOKENS, BLOCK, None, 5)  # this node had no channel to the decode node
    b.open("r", late)
    b.blocks(blocks(epoch=7, reservation_id=5))
    assert not late.came and ended == [(7, 5)]
