"""When a prefill node's streamer prepares and queues a step's groups on a GPU
(prefill_node/kv_stream.py, ``_emit``): nothing before the step's launch, the
groups prepared at the first layer's hook, their headers queued just before
the step's first chunk, and a failure to prepare failing the step's transfers,
not the step. Run on a CPU tensor with the GPU's order switched on."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from common.kv_transfer.channel import TransferError
from common.kv_transfer.loopback import LoopbackSender
from common.kv_transfer.ticket import Destination
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from prefill_node.kv_plan import StepSegment
from prefill_node.kv_stream import KVStreamer
from prefill_node.late_blocks import WAIT_S, LateBlocks

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

    def on_first_token(self, peer, context, token_id) -> None:
        assert self.headers, "a first token before its group's headers"


class _Recording(LoopbackSender):
    def __init__(self, log: list, fail_prepare: bool = False) -> None:
        super().__init__(_Sink())
        self.log = log
        self.fail_prepare = fail_prepare
        self.headers: list = []  # every prepared segment's header
        self.data: list = []  # every chunk's gathered KV

    def prepare_group(self, dest, segments, receiver_rank=0):
        if self.fail_prepare:
            raise OSError("no thread for the link")
        self.log.append("prepare")
        self.headers.extend(s.header for s in segments)
        return super().prepare_group(dest, segments, receiver_rank)

    def post_group(self, group) -> None:
        self.log.append("post")
        super().post_group(group)

    def send_chunk(self, group, segment, desc, data, ready, ready_at, last) -> None:
        if desc is None:  # a first token
            self.log.append(("token", segment.header.reservation_id, int(data[0])))
        else:
            self.log.append(("chunk", desc.layer_start, desc.layer_end))
        self.data.append(data)
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


# ------------------------------------------- blocks that come after the Prefill
BLOCK_TABLE = [1, 2, 3]  # this node's blocks of a 12-token prompt (block size 4)


def _late_streamer(sender, layers_per_chunk: int = 1, last_layers: int = 2) -> KVStreamer:
    """A GPU's order on one rank, where a step waits for late blocks at its
    first due chunk (by default the held chunk of layers 0-3: first_due 3)."""
    streamer = _streamer(sender, layers_per_chunk, last_layers)
    streamer.defer_blocks = True  # as __init__ sets it on a GPU
    return streamer


def _seq(request_id: str, computed: int = 0) -> Sequence:
    return Sequence(
        seq_id=0,
        request_id=request_id,
        index=0,
        token_ids=list(range(12)),
        num_prompt_tokens=12,
        params=SamplingParams(),
        hasher=None,
        num_computed_tokens=computed,
        block_table=list(BLOCK_TABLE),
    )


def _open_late(streamer: KVStreamer, request_id: str, late: LateBlocks):
    """A Prefill whose blocks follow: its destination has no blocks yet."""
    return streamer.open(request_id, DEST, 7, 0, 0, time.monotonic() + 30, False, late=late)


def _kv_of(streamer: KVStreamer, blocks: list[int]) -> torch.Tensor:
    """Every layer's KV of these blocks, as the chunks sent them (concatenated over layers)."""
    return streamer.kv_cache[:, :, blocks]


@pytest.mark.parametrize("when", ["before-the-hook", "during-the-hook"])
def test_late_blocks_are_waited_for_at_the_first_due_chunk_not_before(when):
    log: list = []
    sender = _Recording(log)
    streamer = _late_streamer(sender)
    assert streamer.first_due == 3
    late = LateBlocks(12, 4)  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    assert log == []  # nothing before the launch
    for layer in range(streamer.first_due):
        layer_done(layer)
    assert log == []  # nothing is due before the held chunk: nothing prepared
    if when == "before-the-hook":
        late.set(1, 3)
    else:  # the engine thread waits for them at the hook
        threading.Timer(0.1, late.set, (1, 3)).start()
    layer_done(streamer.first_due)
    assert log[:3] == ["prepare", "post", ("chunk", 0, 4)]
    # The block the decode node holds already (its own prefix cache) is not sent.
    assert [(h.block_start, h.block_end) for h in sender.headers] == [(1, 3), (1, 3)]
    for layer in range(streamer.first_due + 1, NUM_LAYERS):
        layer_done(layer)
    assert torch.equal(torch.cat(sender.data, dim=1), _kv_of(streamer, [2, 3]))
    assert ticket.done.result(timeout=0).num_bytes == 2 * NUM_LAYERS * 2 * streamer.unit_bytes


@pytest.mark.parametrize("when", ["before-the-launch", "after-the-launch"])
def test_blocks_that_came_before_the_first_hook_change_nothing_of_the_order(when):
    log: list = []
    sender = _Recording(log)
    streamer = _late_streamer(sender)
    late = LateBlocks(12, 4)  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    if when == "before-the-launch":
        late.set(1, 3)
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    if when == "after-the-launch":
        late.set(1, 3)
    assert log == []
    layer_done(0)
    assert log == ["prepare"]  # at layer 0's hook, as with blocks known at the start
    for layer in range(1, NUM_LAYERS):
        layer_done(layer)
        if layer < 3:
            assert "post" not in log
    assert log[1:3] == ["post", ("chunk", 0, 4)]
    assert {(h.block_start, h.block_end) for h in sender.headers} == {(1, 3)}
    assert ticket.done.result(timeout=0).num_bytes == 2 * NUM_LAYERS * 2 * streamer.unit_bytes


def test_blocks_that_never_come_fail_the_transfer_when_the_prefill_ends_not_the_step():
    log: list = []
    streamer = _late_streamer(_Recording(log))
    late = LateBlocks(12, 4)  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    for layer in range(streamer.first_due):
        layer_done(layer)
    ended = TransferError("the Prefill ended before the decode node's blocks came")
    threading.Timer(0.1, late.fail, (ended,)).start()  # its session, on the event loop
    began = time.monotonic()
    layer_done(streamer.first_due)  # waits for them, until the Prefill ends
    took = time.monotonic() - began
    assert 0.09 <= took < WAIT_S
    for layer in range(streamer.first_due + 1, NUM_LAYERS):
        layer_done(layer)  # never raises into the forward
    assert log == []  # nothing prepared, nothing queued
    assert ticket.done.exception(timeout=0) is ended


def test_on_a_cpu_the_step_waits_for_late_blocks_before_its_launch():
    log: list = []
    sender = _Recording(log)
    cache = torch.randn(2, NUM_LAYERS, 8, 4, 2, 8)
    streamer = KVStreamer(cache, 4, sender, 1, last_layers=2)
    assert streamer.headers_at_once and not streamer.defer_blocks
    late = LateBlocks(12, 4)  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    threading.Timer(0.1, late.set, (2, 3)).start()
    began = time.monotonic()
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    assert time.monotonic() - began >= 0.09
    assert log == ["prepare", "post"]  # headers queued before the launch
    assert {(h.block_start, h.block_end) for h in sender.headers} == {(2, 3)}
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    assert torch.equal(torch.cat(sender.data, dim=1), _kv_of(streamer, [3]))
    assert ticket.done.result(timeout=0).num_bytes == NUM_LAYERS * 2 * streamer.unit_bytes


@pytest.mark.parametrize("cpu", [False, True], ids=["gpu-order", "cpu-order"])
def test_blocks_that_do_not_fit_the_prompt_fail_its_transfer(cpu):
    log: list = []
    streamer = _late_streamer(_Recording(log))
    if cpu:
        streamer.headers_at_once, streamer.defer_blocks = True, False
    late = LateBlocks(12, 4)  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    if cpu:  # waited for before the launch: the step plans nothing of it
        threading.Timer(0.05, late.set, (0, 5)).start()  # a decode node on another block size
        assert streamer.begin_step(ScheduledBatch([_seq("r")], [12])) is None
    else:  # waited for at the first due chunk
        layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
        late.set(0, 5)
        for layer in range(NUM_LAYERS):
            layer_done(layer)
    assert log == []
    with pytest.raises(ValueError, match="reserved 5 blocks, the prompt has 3"):
        ticket.done.result(timeout=0)


def test_a_chunk_of_blocks_the_decode_node_holds_sends_nothing_and_the_next_goes_on():
    """Chunked prefill: the first step completes blocks 0-1, which the decode
    node turns out to hold already; its segment is dropped, the last step
    sends block 2."""
    log: list = []
    sender = _Recording(log)
    streamer = _late_streamer(sender)
    late = LateBlocks(12, 4)  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    seq = _seq("r")
    layer_done = streamer.begin_step(ScheduledBatch([seq], [8]))
    late.set(2, 3)
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    assert log == [] and ticket.alive
    seq.num_computed_tokens = 8
    layer_done = streamer.begin_step(ScheduledBatch([seq], [4]))
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    assert {(h.block_start, h.block_end) for h in sender.headers} == {(2, 3)}
    assert torch.equal(torch.cat(sender.data, dim=1), _kv_of(streamer, [3]))
    assert ticket.done.result(timeout=0).num_bytes == NUM_LAYERS * 2 * streamer.unit_bytes


@pytest.mark.parametrize("cpu", [False, True], ids=["gpu-order", "cpu-order"])
def test_a_first_token_asked_for_goes_after_the_prompts_last_chunk_once_sampled(cpu):
    log: list = []
    sender = _Recording(log)
    streamer = _streamer(sender, 1, 2)
    streamer.headers_at_once = cpu
    deadline = time.monotonic() + 30
    # "r" asks for its first token on the channel, "s" does not; "t" asks but
    # (never expected) does not sample in the step: -1 keeps the channel in step.
    streamer.open("r", DEST, 7, 0, 3, deadline, False, first_token=True)
    streamer.open("s", DEST, 8, 0, 3, deadline, False)
    streamer.open("t", DEST, 9, 0, 3, deadline, False, first_token=True)
    seqs = [_seq("s"), _seq("r"), _seq("t")]
    seqs[1].num_cached_tokens = 4
    layer_done = streamer.begin_step(ScheduledBatch(seqs, [12, 12, 12]))
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    assert not any(e[0] == "token" for e in log if isinstance(e, tuple))  # not before sampling
    flagged = [h for h in sender.headers if h.has_token]
    # Only the last span of the ones that asked, with this node's cache hit.
    assert [(h.reservation_id, h.layer_start, h.cached_tokens) for h in flagged] == [
        (7, 4, 4),
        (9, 4, 0),
    ]
    streamer.step_sampled(torch.tensor([11, 42, 5]), [0, 1])  # row 2 did not sample
    assert log[-2:] == [("token", 7, 42), ("token", 9, -1)]  # after every chunk, header order
    streamer.step_sampled(torch.tensor([1]), [0])  # the next step: nothing more goes
    assert log[-1] == ("token", 9, -1)


def test_a_tensor_parallel_destination_gets_no_first_token():
    log: list = []
    sender = _Recording(log)
    streamer = _streamer(sender, 1, 0)
    dest = Destination("decode-0", "127.0.0.1", 0, 0, tensor_parallel_size=2)
    streamer.open("r", dest, 7, 0, 3, time.monotonic() + 30, False, first_token=True)
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    streamer.step_sampled(torch.tensor([42]), [0])
    assert not any(h.has_token for h in sender.headers)
    assert not any(e[0] == "token" for e in log if isinstance(e, tuple))
