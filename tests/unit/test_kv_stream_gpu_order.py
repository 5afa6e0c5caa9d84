"""When a prefill node's streamer prepares and queues a step's groups on a GPU
(prefill_node/kv_stream.py, ``_emit``): nothing before the step's launch, the
groups prepared at the first layer's hook, their headers queued just before
the step's first chunk, and a failure to prepare failing the step's transfers,
not the step. Run on a CPU tensor with the GPU's order switched on."""

from __future__ import annotations

import time

import pytest
import torch

from common.kv_transfer.channel import TransferError
from common.kv_transfer.loopback import LoopbackSender
from common.kv_transfer.ticket import Destination
from prefill_node.kv_stream import KVStreamer, StepSegment

NUM_LAYERS = 6
DEST = Destination("decode-0", "127.0.0.1", 0, 0)


class _Sink:
    """Takes what the loopback sender hands over; checks headers come first."""

    def __init__(self) -> None:
        self.headers = 0

    def on_group(self, peer, headers):
        self.headers += len(headers)
        return [object() for _ in headers]

    def on_chunk(self, peer, context, desc, data, stream) -> None:
        assert self.headers, "a chunk before its group's headers"


class _Recording(LoopbackSender):
    def __init__(self, log: list, fail_prepare: bool = False) -> None:
        super().__init__(_Sink())
        self.log = log
        self.fail_prepare = fail_prepare

    def prepare_group(self, dest, segments, receiver_rank=0):
        if self.fail_prepare:
            raise OSError("no thread for the link")
        self.log.append("prepare")
        return super().prepare_group(dest, segments, receiver_rank)

    def post_group(self, group) -> None:
        self.log.append("post")
        super().post_group(group)

    def send_chunk(self, group, segment, desc, data, ready, ready_at, last) -> None:
        self.log.append(("chunk", desc.layer_start, desc.layer_end))
        super().send_chunk(group, segment, desc, data, ready, ready_at, last)


def _streamer(sender, layers_per_chunk: int, last_layers: int) -> KVStreamer:
    # [2, layers, blocks, block_size, kv_heads, head_dim]
    cache = torch.randn(2, NUM_LAYERS, 8, 4, 2, 8)
    streamer = KVStreamer(cache, 4, sender, layers_per_chunk, last_layers=last_layers)
    streamer.headers_at_once = False  # a GPU's order
    return streamer


def _step(streamer: KVStreamer, request_id: str):
    """A one-step prompt of 3 blocks, opened and planned as begin_step would."""
    deadline = time.monotonic() + 30
    ticket = streamer.open(request_id, DEST, 7, 0, 3, deadline, False)
    segment = StepSegment(request_id, DEST, 7, 0, 3, True, [1, 2, 3], deadline)
    return ticket, streamer._emit([segment])


@pytest.mark.parametrize(
    ("layers_per_chunk", "last_layers", "first_chunk_layer"),
    [(1, 0, 0), (1, 2, 3), (0, 0, 5)],
    ids=["every-layer", "first-4-held", "whole-step"],
)
def test_groups_are_prepared_at_the_first_layer_and_queued_with_the_first_chunk(
    layers_per_chunk, last_layers, first_chunk_layer
):
    log: list = []
    streamer = _streamer(_Recording(log), layers_per_chunk, last_layers)
    ticket, layer_done = _step(streamer, "r")
    assert log == []  # nothing before the step's launch
    for layer in range(NUM_LAYERS):
        layer_done(layer)
        if layer == 0:
            assert log[0] == "prepare"
        if layer < first_chunk_layer:
            assert "post" not in log, f"headers queued at layer {layer}"
    post = log.index("post")
    chunks = [e for e in log if isinstance(e, tuple)]
    assert log[post + 1] == chunks[0]  # the headers, then the first chunk at once
    assert chunks[0][2] - 1 == first_chunk_layer  # the layer that completed it
    assert chunks[-1][2] == NUM_LAYERS
    assert ticket.done.result(timeout=0).num_bytes > 0  # everything went


def test_a_group_that_cannot_be_prepared_fails_the_transfer_not_the_step():
    log: list = []
    streamer = _streamer(_Recording(log, fail_prepare=True), 1, 2)
    ticket, layer_done = _step(streamer, "r")
    for layer in range(NUM_LAYERS):
        layer_done(layer)  # never raises into the forward
    assert log == []  # nothing queued
    with pytest.raises(TransferError, match="preparing the step's KV groups failed"):
        ticket.done.result(timeout=0)


def test_another_tensor_parallel_rank_fails_its_own_part_the_same_way():
    """Ranks 1..t-1 emit rank 0's plan with tickets of their own; a group that
    cannot be prepared fails that rank's ticket, and nothing raises into its
    forward."""
    log: list = []
    cache = torch.randn(2, NUM_LAYERS, 8, 4, 2, 8)  # this rank's 2 of 4 KV heads
    streamer = KVStreamer(
        cache,
        4,
        _Recording(log, fail_prepare=True),
        1,
        num_kv_heads=4,
        last_layers=2,
        tp_rank=1,
        tp_size=2,
    )
    streamer.headers_at_once = False
    segment = StepSegment("r", DEST, 7, 0, 3, True, [1, 2, 3], time.monotonic() + 30)
    layer_done = streamer._emit([segment])
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    assert log == []
    with pytest.raises(TransferError, match="preparing the step's KV groups failed"):
        streamer._tickets["r"].done.result(timeout=0)
