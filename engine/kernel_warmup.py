"""Compile, at start-up, the attention kernel variants a server meets later.

Why: a Triton kernel variant first met while serving compiles inside that
step, and every request waits for the compile
(docs/lab/2026-11-25-stalls-under-load.md). Per-step metadata no
longer makes new variants (``engine/layers/attention/triton_jit.py``), but the
kernels still choose constexprs by the step's shape: the short-query tiles
(a prefill of at most 32 tokens), the split prefill and its merge (a short
query over a long cached context), the decode kernel with one split (short
contexts) or several, and the mixed step's slicing. The start-up profile pass
and the CUDA-graph captures meet only some of them.

``warm_up_kernels`` runs one small forward pass of each kind over the real KV
cache, before any request can own a block (the blocks it writes are free and
hold nothing), and throws the results away. A mixture-of-experts model's
fused kernel picks its tiles by the step's token count (a few configs up to
``max_num_batched_tokens``): one expert call per config compiles them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from engine.config import EngineConfig

logger = logging.getLogger(__name__)

# (context already cached, new tokens) per sequence of each warm-up pass.
WARMUP_PASSES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((0, 16),),  # a short prompt: the short-query prefill tiles
    ((0, 64),),  # a prompt: the prefill tiles
    ((1024, 16),),  # a question after a cached system prompt: split prefill + merge
    ((1024, 128), (512, 64)),  # two of them, of different lengths
    ((16, 1),),  # a decode over a short context: one split
    ((2048, 1), (64, 1)),  # decodes over a long context: several splits
    ((2048, 1), (0, 48), (1024, 32)),  # a mixed step: decode and prefill rows sliced apart
)


class _Runner(Protocol):
    """What the warm-up needs of a ModelRunner (which calls it from its __init__)."""

    config: EngineConfig
    block_size: int
    num_kvcache_blocks: int
    device: torch.device
    model: Any

    def build_inputs(self, token_ids, starts, num_new, block_tables) -> Any: ...


@torch.inference_mode()
def warm_up_kernels(runner: _Runner) -> None:
    """One forward pass per entry of WARMUP_PASSES that fits the cache and the
    token budget (a small cache or model length skips the longer ones)."""
    started = time.perf_counter()
    bs = runner.block_size
    cfg = runner.config
    ran = 0
    for seqs in WARMUP_PASSES:
        if any(c + n > cfg.max_model_len for c, n in seqs):
            continue
        if sum(n for _, n in seqs) > cfg.max_num_batched_tokens or len(seqs) > cfg.max_num_seqs:
            continue
        tables, next_block = [], 0
        for cached, new in seqs:
            num_blocks = -(-(cached + new) // bs)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        if next_block > runner.num_kvcache_blocks:
            continue
        inputs = runner.build_inputs(
            [[0] * (c + n) for c, n in seqs], [c for c, _ in seqs], [n for _, n in seqs], tables
        )
        runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        ran += 1
    moe_configs = _warm_up_moe(runner.model, cfg.max_num_batched_tokens)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info(
        "kernel warm-up: %d of %d passes, %d fused-MoE configs in %.1f s",
        ran,
        len(WARMUP_PASSES),
        moe_configs,
        time.perf_counter() - started,
    )


def _warm_up_moe(model: Any, max_tokens: int) -> int:
    """Run the experts of the model's first MoE layer once per launch config that
    a step of 1..max_tokens tokens would pick (no collective: every rank runs it
    alike, but the all-reduce is not needed to compile). Returns how many."""
    from engine.layers.moe.layer import FusedMoE

    layer = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    if layer is None or not layer.use_triton:
        return 0
    w = layer.w13_weight
    first_tokens: dict[Any, int] = {}
    for m in range(1, max_tokens + 1):
        first_tokens.setdefault(layer.kernel_config(m), m)
    for m in first_tokens.values():
        x = torch.zeros(m, w.shape[2], dtype=w.dtype, device=w.device)
        ids = torch.arange(m * layer.top_k, device=w.device, dtype=torch.int32)
        ids = (ids % layer.num_experts).view(m, layer.top_k)
        weights = torch.full((m, layer.top_k), 1.0 / layer.top_k, device=w.device)
        layer.experts(x, weights, ids)
    return len(first_tokens)
