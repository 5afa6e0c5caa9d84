"""The KV gather on the copy engines (engine/copy_engine.py, engine/kv_blocks.py):
bit for bit the blocks ``index_select`` takes, for one run, several, a layer
range, behind work on the engine's stream, and a copy per layer for a cache
whose layer stride is over the driver's pitch limit; a KV-head range and too
many runs go by kernel; a copy the driver refuses turns them off; and the
prefill node's streamer gathers on them, read before the next step writes KV.
Run on a GPU host: ``python -m pytest tests/gpu -m gpu``."""

from __future__ import annotations

import random
import time

import pytest
import torch

from common.kv_transfer.loopback import LoopbackSender
from engine import kv_blocks
from engine.copy_engine import CopyEngine
from engine.kv_blocks import MAX_COPY_RUNS, _copy_runs, block_runs, cache_copier, gather_blocks
from prefill_node.kv_stream import KVStreamer, StepSegment
from tests.engine.test_disaggregation import DEST, blocks_came

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, BS, HEADS, DIM = 6, 64, 16, 4, 32


@pytest.fixture(scope="module")
def cache():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, LAYERS, BLOCKS, BS, HEADS, DIM)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)


class _Counting(CopyEngine):
    """The real copy engines, counting the copies queued on them."""

    def __init__(self, device_index: int) -> None:
        import ctypes

        super().__init__(ctypes.CDLL("libcuda.so.1"), device_index)
        self.copies = 0

    def copy_2d(self, *args) -> bool:
        done = super().copy_2d(*args)
        self.copies += done
        return done


@pytest.fixture
def copier(cache):
    assert cache_copier(cache) is not None  # the driver's, with this cache's pitch
    return _Counting(cache.device.index)


def _gather(cache, ids, layers, heads, copier):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out = gather_blocks(cache, ids, layers, heads, stream, block_runs(ids), copier)
    torch.cuda.current_stream().wait_stream(stream)
    return out


@pytest.mark.parametrize(
    ("ids", "layers"),
    [
        (list(range(10, 42)), None),  # one run, every layer
        (list(range(10, 42)), (0, 4)),  # the held layers
        (list(range(10, 42)), (5, 6)),  # one streamed layer
        ([3, 4, 5, 40, 41, 7, 60, 61, 62, 63], (1, 5)),  # several runs
    ],
)
def test_copies_equal_index_select(cache, copier, ids, layers):
    expected = gather_blocks(cache, ids, layers)
    view = cache if layers is None else cache[:, layers[0] : layers[1]]
    out = torch.empty_like(expected)
    stream = torch.cuda.current_stream()
    assert _copy_runs(view, out, block_runs(ids), copier, stream)  # the copy engines took it
    assert torch.equal(out, expected)
    copies = copier.copies
    assert copies == 2 * len(block_runs(ids))
    assert torch.equal(_gather(cache, ids, layers, None, copier), expected)
    assert copier.copies == 2 * copies  # through gather_blocks too
    assert copier.gathers == 1  # the prefill node's pdserve_kv_gathers_copy_engine_total


def test_what_copies_cannot_take_goes_by_kernel_and_is_still_right(cache, copier):
    stream = torch.cuda.current_stream()
    many = list(range(0, 2 * (MAX_COPY_RUNS + 1), 2))  # every other block: a run each
    sliced = list(range(8, 24))
    for ids, heads in [(many, None), (sliced, (1, 3))]:
        expected = gather_blocks(cache, ids, (0, 3), heads)
        view = cache[:, 0:3, :, :, heads[0] : heads[1]] if heads else cache[:, 0:3]
        assert not _copy_runs(view, torch.empty_like(expected), block_runs(ids), copier, stream)
        assert torch.equal(_gather(cache, ids, (0, 3), heads, copier), expected)
    assert copier.copies == 0


def test_a_layer_stride_over_the_limit_goes_a_layer_per_copy(cache, monkeypatch):
    # This cache's stride taken for one over the limit (the real one: the next test),
    # its small blocks copied a layer at a time all the same.
    monkeypatch.setattr(kv_blocks, "MIN_LAYER_COPY_BYTES", 0)
    pitch = cache.stride(1) * cache.element_size()
    limited = _Counting(cache.device.index)
    limited.max_pitch = pitch - 1
    ids = [3, 4, 5, 40, 41]  # two runs
    expected = gather_blocks(cache, ids, (0, 3))
    assert torch.equal(_gather(cache, ids, (0, 3), None, limited), expected)
    assert limited.copies == 2 * 2 * 3 and not limited.refused  # runs x K/V x layers


def test_a_cache_over_the_devices_pitch_limit_is_gathered_by_copies():
    # A layer stride over the driver's limit (2 GiB on current GPUs): ~9 GB of cache.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    probe = _Counting(torch.cuda.current_device())
    block_bytes = BS * 8 * 128 * 2  # bf16, 8 heads of 128
    blocks = probe.max_pitch // block_bytes + 2
    big = torch.empty((2, 2, blocks, BS, 8, 128), device="cuda", dtype=torch.bfloat16)
    try:
        assert big.stride(1) * big.element_size() > probe.max_pitch
        # The far end of each layer, a run of MIN_LAYER_COPY_BYTES (4 MiB): by copies.
        ids = list(range(blocks - kv_blocks.MIN_LAYER_COPY_BYTES // block_bytes, blocks))
        big[:, :, ids[0] :].normal_()
        copier = cache_copier(big)
        assert copier is not None and isinstance(copier, CopyEngine)
        counting = _Counting(big.device.index)
        expected = gather_blocks(big, ids)
        assert torch.equal(_gather(big, ids, None, None, counting), expected)
        assert counting.copies == 2 * 2 and counting.gathers == 1  # K/V x layers, one run
        # A shorter run: by kernel (copies of a layer's few blocks cost the SMs more).
        short = ids[-16:]
        assert torch.equal(_gather(big, short, None, None, counting), gather_blocks(big, short))
        assert counting.copies == 2 * 2 and counting.gathers == 1
    finally:
        del big
        torch.cuda.empty_cache()


def test_a_copy_the_driver_refuses_turns_the_copy_engines_off(cache, copier):
    stream = torch.cuda.current_stream().cuda_stream
    scratch = torch.zeros(4096, dtype=torch.uint8, device=cache.device)
    # Rows wider than their pitch: the driver checks that before it queues anything.
    assert not copier.copy_2d(scratch.data_ptr(), 256, scratch.data_ptr(), 256, 512, 2, stream)
    assert copier.refused  # never asked again
    ids = list(range(8, 24))
    assert torch.equal(_gather(cache, ids, (0, 3), None, copier), gather_blocks(cache, ids, (0, 3)))
    torch.cuda.synchronize()  # the context is fine


def test_random_runs_behind_the_layer_that_writes_them(cache, copier):
    # Gathers on a side stream behind the engine's stream, as the streamer's:
    # each reads what the engine's stream wrote just before (after a delay).
    rng = random.Random(1)
    kv = cache.clone()
    for i in range(20):
        start = rng.randrange(0, BLOCKS - 20)
        ids = list(range(start, start + rng.randrange(1, 20)))
        cut = rng.randrange(0, len(ids))
        ids = ids[cut:] + ids[:cut]  # two runs
        layers = (rng.randrange(0, 3), rng.randrange(3, LAYERS + 1))
        torch.cuda._sleep(10_000_000)  # the engine's stream busy, then its KV writes
        kv[:, :, ids] = float(i + 1)
        out = _gather(kv, ids, layers, None, copier)
        assert torch.equal(out, torch.full_like(out, float(i + 1)))
    assert copier.copies > 0


class _Keep(LoopbackSender):
    """Keeps each chunk the streamer queues (on the device, unread)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.chunks: list = []

    def post_group(self, group) -> None:
        group.contexts = [None] * len(group.segments)

    def send_chunk(self, group, segment, desc, data, ready, ready_at, last) -> None:
        self.chunks.append((desc, data))


def test_the_next_step_waits_for_the_streamers_gathers_before_writing_kv(cache):
    kv = cache.clone()
    sender = _Keep()
    streamer = KVStreamer(kv, BS, sender, 1, last_layers=2)
    streamer.copier = _Counting(kv.device.index)
    blocks = [20, 21, 22, 23, 40]
    expected = kv[:, :, blocks].clone()
    torch.empty_like(expected).zero_()  # loads the fill kernel (a first load synchronises)
    deadline = time.monotonic() + 30
    dest = DEST
    for request_id in ("warm-up", "r"):  # the first fills the allocators' caches
        sender.chunks.clear()
        came = blocks_came(request_id, 7, 0, len(blocks), len(blocks) * BS, BS)
        streamer.open(request_id, came, deadline, False)
        segment = StepSegment(request_id, dest, 7, 0, len(blocks), True, blocks, deadline)
        layer_done = streamer._emit([segment])
        with torch.cuda.stream(streamer.gather_stream):
            torch.cuda._sleep(500_000_000)  # the gathers queue behind this (about 0.25 s)
            slept = torch.cuda.Event()
            slept.record()
        for layer in range(LAYERS):
            layer_done(layer)
        assert streamer.begin_step(None) is None  # the next step: nothing of its own to stream
        if request_id == "warm-up":
            torch.cuda.synchronize()
    kv.zero_()  # the next step's KV writes, on the engine's stream
    # Queued while the gathers still waited (nothing on the way synchronised).
    assert not slept.query()
    torch.cuda.synchronize()
    assert [(d.layer_start, d.layer_end) for d, _ in sender.chunks] == [(0, 4), (4, 5), (5, 6)]
    for desc, data in sender.chunks:
        assert torch.equal(data, expected[:, desc.layer_start : desc.layer_end])
    assert streamer.copier.copies == 2 * (2 * 2 * 3)  # 2 requests: 2 runs, K/V, 3 chunks
    assert streamer.copier.gathers == 2 * 3
