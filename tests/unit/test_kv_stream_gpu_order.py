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
from common.kv_transfer.protocol import parse_first_token
from common.kv_transfer.ticket import Destination
from engine.layers.sampler import DeviceSamples
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from prefill_node.destinations import WAIT_S, PendingDestination
from prefill_node.kv_stream import KVStreamer, StepSegment
from proto import internal_pb2

NUM_LAYERS = 6
DEST = Destination("decode-0", "127.0.0.1", 0, 0)


def _pending(reservation_id: int = 7, decode_tp: int = 1) -> PendingDestination:
    """A Prefill of a 12-token prompt (3 blocks of 4) bound for decode-0."""
    request = internal_pb2.PrefillRequest(
        prompt_token_ids=list(range(12)),
        decode_node_id="decode-0",
        decode_tensor_parallel_size=decode_tp,
        reservation_id=reservation_id,
    )
    return PendingDestination(request, 4)


def _blocks(first: int, num: int, reservation_id: int = 7, decode_tp: int = 1):
    """The decode node's blocks, on DEST's channel."""
    blocks = internal_pb2.PrefillBlocks(
        reservation_id=reservation_id, first_block=first, num_blocks=num
    )
    blocks.channel.node_id, blocks.channel.store_host = DEST.node_id, DEST.store_host
    blocks.channel.epoch, blocks.channel.tensor_parallel_size = DEST.epoch, decode_tp
    return blocks


def _came(pending: PendingDestination, first: int, num: int) -> PendingDestination:
    pending.set(_blocks(first, num, pending.reservation_id, pending.decode_tp))
    return pending


def _samples(token_ids: list[int], logprobs: tuple | None = None) -> DeviceSamples:
    """A step's samples as the sampler leaves them on the device."""
    if logprobs is None:
        return DeviceSamples(torch.tensor(token_ids), [None] * len(token_ids))
    rows, k, tensors = logprobs
    want = [k if i in rows else None for i in range(len(token_ids))]
    return DeviceSamples(torch.tensor(token_ids), want, rows, tensors)


class _Sink:
    """Takes what the loopback sender hands over; checks headers come first."""

    def __init__(self) -> None:
        self.headers = 0

    def on_group(self, peer, headers):
        self.headers += len(headers)
        return [object() for _ in headers]

    def on_chunk(self, peer, context, desc, data, stream) -> None:
        assert self.headers, "a chunk before its group's headers"

    def on_first_token(self, peer, context, token) -> None:
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
            token = parse_first_token(segment.header, data.numpy().tobytes())
            self.log.append(("token", segment.header.reservation_id, token.token_id))
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
    ticket = streamer.open(request_id, _came(_pending(), 0, 3), deadline, False)
    streamer._take_blocks(streamer._streams[request_id], deadline)
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


# ------------------------------------------- the decode node's blocks, after the Prefill
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


def _open_late(streamer: KVStreamer, request_id: str, late: PendingDestination):
    """A Prefill whose decode node's blocks have not come yet."""
    return streamer.open(request_id, late, time.monotonic() + 30, False)


def _kv_of(streamer: KVStreamer, blocks: list[int]) -> torch.Tensor:
    """Every layer's KV of these blocks, as the chunks sent them (concatenated over layers)."""
    return streamer.kv_cache[:, :, blocks]


@pytest.mark.parametrize("when", ["before-the-hook", "during-the-hook"])
def test_blocks_are_waited_for_at_the_first_due_chunk_not_before(when):
    log: list = []
    sender = _Recording(log)
    streamer = _late_streamer(sender)
    assert streamer.first_due == 3
    late = _pending()  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    assert log == []  # nothing before the launch
    for layer in range(streamer.first_due):
        layer_done(layer)
    assert log == []  # nothing is due before the held chunk: nothing prepared
    if when == "before-the-hook":
        _came(late, 1, 3)
    else:  # the engine thread waits for them at the hook
        threading.Timer(0.1, _came, (late, 1, 3)).start()
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
    late = _pending()  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    if when == "before-the-launch":
        _came(late, 1, 3)
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    if when == "after-the-launch":
        _came(late, 1, 3)
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
    late = _pending()  # 3 blocks of 4 tokens
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


def test_on_a_cpu_the_step_waits_for_the_blocks_before_its_launch():
    log: list = []
    sender = _Recording(log)
    cache = torch.randn(2, NUM_LAYERS, 8, 4, 2, 8)
    streamer = KVStreamer(cache, 4, sender, 1, last_layers=2)
    assert streamer.headers_at_once and not streamer.defer_blocks
    late = _pending()  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    threading.Timer(0.1, _came, (late, 2, 3)).start()
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
    late = _pending()  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    if cpu:  # waited for before the launch: the step plans nothing of it
        threading.Timer(0.05, _came, (late, 0, 5)).start()  # a decode node on another block size
        assert streamer.begin_step(ScheduledBatch([_seq("r")], [12])) is None
    else:  # waited for at the first due chunk
        layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
        _came(late, 0, 5)
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
    late = _pending()  # 3 blocks of 4 tokens
    ticket = _open_late(streamer, "r", late)
    seq = _seq("r")
    layer_done = streamer.begin_step(ScheduledBatch([seq], [8]))
    _came(late, 2, 3)
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


def _open_all(streamer: KVStreamer, *opened) -> None:
    """Prefills whose blocks all came, on DEST's channel: (request, reservation, logprobs)."""
    deadline = time.monotonic() + 30
    for rid, reservation_id, logprobs in opened:
        streamer.open(rid, _came(_pending(reservation_id), 0, 3), deadline, False, logprobs)


@pytest.mark.parametrize("cpu", [False, True], ids=["gpu-order", "cpu-order"])
def test_every_prompts_first_token_goes_after_its_last_chunk_once_sampled(cpu):
    log: list = []
    sender = _Recording(log)
    streamer = _streamer(sender, 1, 2)
    streamer.headers_at_once = cpu
    # "t" (never expected) does not sample in the step: -1 keeps the channel in step.
    _open_all(streamer, ("r", 7, -1), ("s", 8, -1), ("t", 9, -1))
    seqs = [_seq("s"), _seq("r"), _seq("t")]
    seqs[1].num_cached_tokens = 4
    layer_done = streamer.begin_step(ScheduledBatch(seqs, [12, 12, 12]))
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    assert not any(e[0] == "token" for e in log if isinstance(e, tuple))  # not before sampling
    flagged = [h for h in sender.headers if h.has_token]
    # Only the last span, with this node's cache hit.
    assert [(h.reservation_id, h.layer_start, h.cached_tokens) for h in flagged] == [
        (8, 4, 0),
        (7, 4, 4),
        (9, 4, 0),
    ]
    streamer.step_sampled(_samples([11, 42, 5]), [0, 1])  # row 2 did not sample
    # After every chunk, in header order.
    assert log[-3:] == [("token", 8, 11), ("token", 7, 42), ("token", 9, -1)]
    streamer.step_sampled(_samples([1]), [0])  # the next step: nothing more goes
    assert log[-1] == ("token", 9, -1)


def test_a_first_token_carries_its_logprobs_where_the_request_asked():
    log: list = []
    sender = _Recording(log)
    streamer = _streamer(sender, 0, 0)
    _open_all(streamer, ("r", 7, 2), ("s", 8, -1))
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r"), _seq("s")], [12, 12]))
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    header = next(h for h in sender.headers if h.reservation_id == 7)
    assert header.has_logprobs and header.top_logprobs == 2
    assert not next(h for h in sender.headers if h.reservation_id == 8).has_logprobs
    # The sampler's logprobs of row 0 (three best ids computed, two asked for).
    tensors = (
        torch.tensor([-0.25]),
        torch.tensor([2]),
        torch.tensor([[5, 42, 9]]),
        torch.tensor([[-0.1, -0.25, -3.0]]),
    )
    streamer.step_sampled(_samples([42, 11], ([0], 2, tensors)), [0, 1])
    token = parse_first_token(header, sender.data[-2].numpy().tobytes())
    assert token.token_id == 42
    assert token.logprobs == (-0.25, 2, [5, 42], [pytest.approx(-0.1), -0.25])
    assert log[-2:] == [("token", 7, 42), ("token", 8, 11)]


def test_a_tensor_parallel_decode_node_gets_its_first_token_on_rank_0s_channel():
    log: list = []
    sender = _Recording(log)
    cache = torch.randn(2, NUM_LAYERS, 8, 4, 2, 8)  # 2 KV heads, decode node of 2 ranks
    streamer = KVStreamer(cache, 4, sender, 1, last_layers=0)
    streamer.headers_at_once = False
    deadline = time.monotonic() + 30
    streamer.open("r", _came(_pending(7, decode_tp=2), 0, 3), deadline, False)
    layer_done = streamer.begin_step(ScheduledBatch([_seq("r")], [12]))
    for layer in range(NUM_LAYERS):
        layer_done(layer)
    streamer.step_sampled(_samples([42]), [0])
    groups = {g.receiver_rank: g for g in sender.groups}
    assert set(groups) == {0, 1}
    flagged = [rank for rank, g in groups.items() if any(s.header.has_token for s in g.segments)]
    assert flagged == [0]
    assert log[-1] == ("token", 7, 42)
