"""Runs of block ids (engine/kv_blocks.py), which decide where a KV gather can
go on the copy engines; the copies themselves are tested on a GPU
(tests/gpu/test_copy_engine_cuda.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from engine.copy_engine import CopyEngine
from engine.kv_blocks import block_runs, gather_blocks


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


def test_no_copy_engine_without_a_driver_library():
    # This CI host has no NVIDIA driver: the gather stays on kernels (or the CPU).
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: tests/gpu covers the copies")
    assert CopyEngine.load(0) is None


def test_a_cpu_gather_ignores_runs_and_takes_the_blocks_in_order():
    kv = torch.arange(2 * 3 * 8 * 2 * 2 * 4, dtype=torch.float32).view(2, 3, 8, 2, 2, 4)
    ids = [5, 6, 1]
    out = gather_blocks(kv, ids, (1, 3), None, None, block_runs(ids), None)
    assert torch.equal(out, kv[:, 1:3, ids])


class _Driver:
    """Stands in for libcuda on a host without one: C-callable functions through
    ctypes, as ``CopyEngine`` calls them; the copy is refused with ``status``."""

    def __init__(self, status: int, max_pitch: int = (1 << 31) - 1) -> None:
        self.calls = 0

        def attribute(out, attribute, device):
            out[0] = max_pitch
            return 0

        def copy(params, stream):
            self.calls += 1
            return status

        self.cuDeviceGetAttribute = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int
        )(attribute)
        self.cuMemcpy2DAsync_v2 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
            copy
        )


def test_a_copy_the_driver_refuses_turns_the_copy_engines_off_for_good():
    driver = _Driver(status=1)  # CUDA_ERROR_INVALID_VALUE
    engine = CopyEngine(driver, 0)
    assert engine.max_pitch == (1 << 31) - 1
    assert not engine.copy_2d(4096, 8192, 8192, 8192, 4096, 4, 0)
    assert engine.max_pitch == 0
    assert not engine.copy_2d(4096, 8192, 8192, 8192, 4096, 4, 0)
    assert driver.calls == 1  # never asked again: no log line per chunk


def test_a_pitch_over_the_devices_limit_is_not_asked_for():
    driver = _Driver(status=0, max_pitch=1 << 20)
    engine = CopyEngine(driver, 0)
    assert engine.copy_2d(0, 1 << 20, 0, 1 << 20, 4096, 4, 0)
    assert not engine.copy_2d(0, 1 << 20, 0, (1 << 20) + 1, 4096, 4, 0)
    assert driver.calls == 1 and engine.max_pitch == 1 << 20  # a limit is not a refusal
