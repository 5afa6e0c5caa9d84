"""The host tier's pinned staging pool: batches reuse buffers, allocate rarely."""

from __future__ import annotations

import itertools

import torch

from engine.tier_copies import _ALIGN, StagingPool, _Carver


def test_a_batch_reuses_a_given_back_buffer_and_only_growth_allocates():
    pool = StagingPool(1000, count=2, pin=False)
    a = pool.take(600)
    b = pool.take(1000)
    assert pool.num_free == 0 and pool.num_allocations == 2
    pool.give(a)
    pool.give(b)
    for _ in range(5):  # the same batch shape again and again: no allocation
        buf = pool.take(900)
        pool.give(buf)
    assert pool.num_allocations == 2
    big = pool.take(1500)  # outgrows both: one new buffer, twice the largest
    assert big.numel() == 2000 and pool.num_allocations == 3
    huge = pool.take(10_000)  # more than twice: exactly what is asked
    assert huge.numel() == 10_000 and pool.num_allocations == 4
    pool.give(big)
    pool.give(huge)
    assert pool.take(1200) is big  # the smallest that fits
    assert pool.take(100).numel() == 1000


def test_carved_views_are_aligned_disjoint_and_fit_the_size_asked():
    shapes = [((3,), torch.int64), ((2, 5, 3), torch.bfloat16), ((7,), torch.int64)]
    shapes.append(((2, 1, 3), torch.float32))
    buf = torch.zeros(_Carver.size(shapes), dtype=torch.uint8)
    carve = _Carver(buf)
    views = [carve.view(shape, dtype) for shape, dtype in shapes]
    spans = []
    for v, (shape, dtype) in zip(views, shapes, strict=True):
        assert v.shape == shape and v.dtype == dtype and v.is_contiguous()
        start = v.data_ptr() - buf.data_ptr()
        assert start % _ALIGN == 0
        spans.append((start, start + v.numel() * v.element_size()))
    assert spans[-1][1] == buf.numel()  # the size is exact
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for i, v in enumerate(views):
        v.fill_(i + 1)  # each view writes only its own bytes
    for i, v in enumerate(views):
        assert bool((v == i + 1).all())
