"""The punica shrink / expand Triton kernels against the torch path
(engine/lora/punica.py): rows of several slots and of none (-1), ranks and
slices as a fused q/k/v projection has them, output offsets.

Interpreter on CPU in CI (fp32, small shapes); natively on a GPU host (bf16 too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.lora.punica import LoRABatch, expand, shrink

pytest.importorskip("engine.lora.punica_triton", reason="triton is not installed")

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]
TOKENS = [1, 7, 64, 300] if ON_GPU else [1, 7]


def _run(x, a, bs, slots, rank, use_triton, dtype):
    batch = LoRABatch.build(slots, torch.from_numpy(slots).to(DEVICE), use_triton)
    gen = torch.Generator().manual_seed(1)
    y = torch.randn(x.shape[0], sum(b.shape[1] for b in bs), generator=gen).to(DEVICE, dtype)
    u = shrink(x, a, batch)
    offset = 0
    for i, b in enumerate(bs):
        expand(y, u[:, i * rank : (i + 1) * rank], b, batch, offset)
        offset += b.shape[1]
    return u, y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_triton_shrink_expand_equal_the_torch_path(dtype, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    # Three slices (q, k, v of a fused projection); K and N not tile multiples.
    loras, rank, slices, k = 3, 8, (40, 24, 24), 200
    x = torch.randn(num_tokens, k, generator=gen).to(DEVICE, dtype)
    a = torch.randn(loras, len(slices) * rank, k, generator=gen).to(DEVICE, dtype)
    bs = [torch.randn(loras, n, rank, generator=gen).to(DEVICE, dtype) for n in slices]
    slots = torch.randint(-1, loras, (num_tokens,), generator=gen).numpy().astype(np.int32)
    slots[0] = -1  # a base-model row in every case
    u_ref, y_ref = _run(x, a, bs, slots, rank, False, dtype)
    u_tri, y_tri = _run(x, a, bs, slots, rank, True, dtype)
    tol = 1e-4 if dtype is torch.float32 else 3e-2
    assert torch.allclose(u_tri, u_ref, rtol=tol, atol=tol * 10)
    assert torch.allclose(y_tri.float(), y_ref.float(), rtol=tol, atol=tol * 30)
    assert (u_tri[torch.from_numpy(slots < 0).to(DEVICE)] == 0).all()
