"""LateBoard: a decode node's blocks matched to a Prefill whichever session
brought either (prefill_node/late_blocks.py), and a router's Prefill's checks."""

from __future__ import annotations

import time

import pytest

from common.kv_transfer.channel import TransferError
from common.reliability import StaleChannel
from prefill_node import late_blocks
from prefill_node.late_blocks import LateBlocks, LateBoard
from proto import internal_pb2

BLOCK = 16
TOKENS = 40  # 3 blocks


def blocks(rid="r", first=0, num=3, epoch=None, reservation_id=0):
    b = internal_pb2.PrefillBlocks(request_id=rid, first_block=first, num_blocks=num)
    if epoch is not None:
        b.channel_epoch = epoch
        b.reservation_id = reservation_id
    return b


def test_a_decode_nodes_own_prefill_takes_its_blocks_unchecked():
    board, late = LateBoard(), LateBlocks(TOKENS, BLOCK)
    board.open("r", late)
    board.blocks(blocks(first=1))
    assert late.came and late.wait(0) == (1, 3)


def test_blocks_before_a_dispatched_prefill_wait_for_it():
    board = LateBoard()
    board.blocks(blocks(first=2, epoch=7, reservation_id=1 << 62))  # the router's came later
    late = LateBlocks(TOKENS, BLOCK, epoch=7, reservation_id=1 << 62)
    board.open("r", late)
    assert late.wait(0) == (2, 3)


def test_a_classic_prefills_blocks_without_it_are_dropped():
    # A decode node's own Prefill comes first on its session: blocks for none
    # are of one that ended, never kept for a later Prefill of the same id.
    board = LateBoard()
    board.blocks(blocks(first=2))
    late = LateBlocks(TOKENS, BLOCK)
    board.open("r", late)
    assert not late.ready


def test_another_epoch_fails_a_dispatched_prefill_as_a_stale_channel():
    board, late = LateBoard(), LateBlocks(TOKENS, BLOCK, epoch=7, reservation_id=5)
    board.open("r", late)
    board.blocks(blocks(epoch=8, reservation_id=5))
    assert not late.came
    with pytest.raises(StaleChannel, match="epoch 8"):
        late.wait(0)


def test_another_reservation_id_fails_a_dispatched_prefill():
    board, late = LateBoard(), LateBlocks(TOKENS, BLOCK, epoch=7, reservation_id=5)
    board.open("r", late)
    board.blocks(blocks(epoch=7, reservation_id=6))
    with pytest.raises(ValueError, match="reservation 6"):
        late.wait(0)


def test_blocks_that_do_not_fit_the_prompt_fail_it():
    board, late = LateBoard(), LateBlocks(TOKENS, BLOCK, epoch=7, reservation_id=5)
    board.open("r", late)
    board.blocks(blocks(num=4, epoch=7, reservation_id=5))
    with pytest.raises(ValueError, match="reserved 4 blocks"):
        late.wait(0)


def test_closing_wakes_the_wait_and_forgets_the_prefill():
    board, late = LateBoard(), LateBlocks(TOKENS, BLOCK)
    board.open("r", late)
    board.close("r", late)
    with pytest.raises(TransferError, match="ended"):
        late.wait(0)
    board.blocks(blocks())  # after its end: nothing to give it to
    assert not late.came


def test_early_blocks_are_kept_for_wait_s_at_most(monkeypatch):
    board = LateBoard()
    board.blocks(blocks("old", epoch=7, reservation_id=5))
    now = time.monotonic()
    monkeypatch.setattr(late_blocks.time, "monotonic", lambda: now + late_blocks.WAIT_S + 1)
    board.blocks(blocks("new", epoch=7, reservation_id=6))  # sweeps the old one
    late = LateBlocks(TOKENS, BLOCK, epoch=7, reservation_id=5)
    board.open("old", late)
    assert not late.ready
    late = LateBlocks(TOKENS, BLOCK, epoch=7, reservation_id=6)
    board.open("new", late)
    assert late.came
