"""Runs of block ids and the copy-engine gather's bookkeeping (engine/kv_blocks.py,
engine/copy_engine.py), on a host without a GPU: the driver's pitched copy is
stood in for by one that does what cuMemcpy2DAsync does, on host memory, so
that every offset, pitch and width the gather computes is checked against
``index_select``. The real copies: tests/gpu/test_copy_engine_cuda.py."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine import kv_blocks
from engine.copy_engine import CopyEngine, _Memcpy2D
from engine.kv_blocks import MAX_COPIES, MAX_COPY_RUNS, _copy_runs, block_runs, gather_blocks


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([], []),
        ([7], [(7, 1)]),
        ([3, 4, 5, 6], [(3, 4)]),
        ([3, 4, 9, 10, 11, 2], [(3, 2), (9, 3), (2, 1)]),
        ([5, 4, 3], [(5, 1), (4, 1), (3, 1)]),  # descending: no run
        ([1, 1, 2], [(1, 1), (1, 2)]),
    ],
)
def test_runs_of_consecutive_ascending_ids(ids, runs):
    assert block_runs(ids) == runs
    assert [b for first, n in runs for b in range(first, first + n)] == ids


class _Driver:
    """libcuda's three calls as ``CopyEngine`` makes them (C functions through
    ctypes); the pitched copy done with memmove on host addresses, or refused
    with ``status``."""

    def __init__(self, status: int = 0, max_pitch: int = (1 << 31) - 1) -> None:
        self.copies: list[tuple[int, int, int, int, int, int]] = []

        def device(out, ordinal):
            out[0] = ordinal
            return 0

        def attribute(out, attribute, device):
            assert attribute == 11  # CU_DEVICE_ATTRIBUTE_MAX_PITCH
            out[0] = max_pitch
            return 0

        def copy(params, stream):
            m = ctypes.cast(params, ctypes.POINTER(_Memcpy2D)).contents
            assert (m.srcMemoryType, m.dstMemoryType) == (2, 2)  # CU_MEMORYTYPE_DEVICE
            assert m.srcXInBytes == m.srcY == m.dstXInBytes == m.dstY == 0
            self.copies.append(
                (m.srcDevice, m.srcPitch, m.dstDevice, m.dstPitch, m.WidthInBytes, m.Height)
            )
            if status != 0:
                return status
            for row in range(m.Height):
                ctypes.memmove(
                    m.dstDevice + row * m.dstPitch, m.srcDevice + row * m.srcPitch, m.WidthInBytes
                )
            return 0

        int_p = ctypes.POINTER(ctypes.c_int)
        self.cuDeviceGet = ctypes.CFUNCTYPE(ctypes.c_int, int_p, ctypes.c_int)(device)
        self.cuDeviceGetAttribute = ctypes.CFUNCTYPE(
            ctypes.c_int, int_p, ctypes.c_int, ctypes.c_int
        )(attribute)
        self.cuMemcpy2DAsync_v2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
            copy
        )


class _Stream:
    cuda_stream = 0


def _cache(dtype=torch.float32) -> torch.Tensor:
    # [2, layers, blocks, block_size, kv_heads, head_dim]
    n = 2 * 5 * 40 * 4 * 3 * 8
    return torch.arange(n, dtype=torch.int64).remainder(251).to(dtype).view(2, 5, 40, 4, 3, 8)


# (block ids, layer range) of the gathers the copies are checked on.
GATHERS = [
    (list(range(10, 26)), None),  # one run, every layer
    (list(range(10, 26)), (0, 3)),  # held layers
    (list(range(10, 26)), (4, 5)),  # one layer
    ([3, 4, 5, 30, 31, 7, 38, 39], (1, 4)),  # several runs
]


def _copied(cache, ids, layers, driver):
    """The layer range's view and the engine, once the copies equalled index_select's."""
    engine = CopyEngine(driver, 0)
    expected = gather_blocks(cache, ids, layers)
    view = cache if layers is None else cache[:, layers[0] : layers[1]]
    out = torch.full_like(expected, 7)
    assert _copy_runs(view, out, block_runs(ids), engine, _Stream())
    assert torch.equal(out, expected)
    return view, engine


def test_the_struct_is_the_drivers():
    assert ctypes.sizeof(_Memcpy2D) == 128  # CUDA_MEMCPY2D_v2 on a 64-bit host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize(("ids", "layers"), GATHERS)
def test_the_copies_take_the_blocks_index_select_takes(dtype, ids, layers):
    cache = _cache(dtype)
    driver = _Driver()
    view, _ = _copied(cache, ids, layers, driver)
    assert len(driver.copies) == 2 * len(block_runs(ids))  # per run and K/V half
    row = view.shape[3] * view.shape[4] * view.shape[5] * view.element_size()
    assert all(c[1] == cache.stride(1) * cache.element_size() for c in driver.copies)
    assert all(c[3] == len(ids) * row for c in driver.copies)  # the output's layer stride
    assert all(c[5] == view.shape[1] for c in driver.copies)  # a row per layer


@pytest.mark.parametrize(
    ("case", "ids", "runs"),
    [
        ("too many runs", list(range(0, 2 * (MAX_COPY_RUNS + 1), 2)), None),
        ("runs longer than the ids", [4, 5, 6], [(4, 4)]),
        ("a run past the cache", [38, 39], [(38, 3)]),
        ("a negative id", [0, 1], [(-1, 2)]),
    ],
)
def test_what_the_copies_cannot_take_is_left_to_the_kernel(case, ids, runs):
    cache = _cache()
    driver = _Driver()
    out = torch.empty(2, 5, len(ids), 4, 3, 8)
    assert not _copy_runs(cache, out, runs or block_runs(ids), CopyEngine(driver, 0), _Stream())
    assert driver.copies == []  # nothing queued


def test_a_view_whose_blocks_are_not_contiguous_is_left_to_the_kernel():
    cache = _cache()
    driver, ids = _Driver(), list(range(8, 16))
    engine = CopyEngine(driver, 0)
    heads = cache[:, :, :, :, 1:3]  # a KV-head range
    swapped = cache.transpose(4, 5).contiguous().transpose(4, 5)  # same shape, other order
    for view in (heads, swapped):
        out = torch.empty(2, 5, len(ids), *view.shape[3:])
        assert not _copy_runs(view, out, block_runs(ids), engine, _Stream())
    assert driver.copies == []


def test_a_copy_the_driver_refuses_turns_the_copy_engines_off_for_good():
    driver = _Driver(status=1)  # CUDA_ERROR_INVALID_VALUE
    engine = CopyEngine(driver, 0)
    cache, ids = _cache(), list(range(8, 16))
    out = torch.empty(2, 5, len(ids), 4, 3, 8)
    assert not _copy_runs(cache, out, block_runs(ids), engine, _Stream())
    assert engine.refused
    assert not _copy_runs(cache, out, block_runs(ids), engine, _Stream())
    assert len(driver.copies) == 1  # never asked again: no log line per chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("ids", "layers"), GATHERS)
def test_a_layer_stride_over_the_pitch_limit_is_copied_a_layer_at_a_time(
    dtype, ids, layers, monkeypatch
):
    # A large cache's layer stride is over the driver's limit (2 GiB): a copy per
    # layer, of runs of any size here (these blocks are bytes, not megabytes).
    monkeypatch.setattr(kv_blocks, "MIN_LAYER_COPY_BYTES", 0)
    cache = _cache(dtype)
    driver = _Driver(max_pitch=cache.stride(1) * cache.element_size() - 1)
    view, engine = _copied(cache, ids, layers, driver)
    assert not engine.refused  # a limit is not a refusal
    # Per run, K/V half and layer; one row each, its pitches within the limit.
    assert len(driver.copies) == 2 * len(block_runs(ids)) * view.shape[1]
    assert all(c[5] == 1 and c[1] == c[3] == c[4] for c in driver.copies)


def test_runs_too_short_to_copy_a_layer_at_a_time_are_left_to_the_kernel(monkeypatch):
    cache = _cache()
    block_bytes = 4 * 3 * 8 * cache.element_size()
    monkeypatch.setattr(kv_blocks, "MIN_LAYER_COPY_BYTES", 4 * block_bytes)
    driver = _Driver(max_pitch=cache.stride(1) * cache.element_size() - 1)
    engine = CopyEngine(driver, 0)
    short = [3, 4, 5, 10, 11, 12, 13]  # a run of 3 blocks: under the minimum
    out = torch.empty(2, 5, len(short), 4, 3, 8)
    assert not _copy_runs(cache, out, block_runs(short), engine, _Stream())
    assert driver.copies == []
    long = [3, 4, 5, 6, 10, 11, 12, 13]  # both runs at the minimum
    out = torch.empty(2, 5, len(long), 4, 3, 8)
    assert _copy_runs(cache, out, block_runs(long), engine, _Stream())
    assert torch.equal(out, gather_blocks(cache, long))


def test_more_copies_a_layer_at_a_time_than_the_cap_are_left_to_the_kernel(monkeypatch):
    monkeypatch.setattr(kv_blocks, "MIN_LAYER_COPY_BYTES", 0)
    cache = _cache()  # 5 layers: 10 copies per run
    driver = _Driver(max_pitch=cache.stride(1) * cache.element_size() - 1)
    runs = MAX_COPIES // 10 + 1
    ids = [b for r in range(runs) for b in (3 * r, 3 * r + 1)]
    assert runs <= MAX_COPY_RUNS and len(block_runs(ids)) == runs
    out = torch.empty(2, 5, len(ids), 4, 3, 8)
    assert not _copy_runs(cache, out, block_runs(ids), CopyEngine(driver, 0), _Stream())
    assert driver.copies == []


def test_no_copy_engine_without_a_driver_library():
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert CopyEngine.load(0) is None
    else:
        pytest.skip("this host has a CUDA driver library: tests/gpu covers the copies")


def test_a_cpu_gather_takes_the_blocks_in_order_whatever_runs_it_is_given():
    cache = _cache()
    ids = [5, 6, 1]
    out = gather_blocks(cache, ids, (1, 3), None, None, block_runs(ids), None)
    assert torch.equal(out, cache[:, 1:3, ids])
