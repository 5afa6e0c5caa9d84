"""Runs of block ids (engine/kv_blocks.py), which decide where a KV gather can
go on the copy engines; the copies themselves are tested on a GPU
(tests/gpu/test_copy_engine_cuda.py)."""

from __future__ import annotations

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
