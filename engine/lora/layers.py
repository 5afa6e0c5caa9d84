"""LoRA on the model's fused projections: which slice of each fused output an
adapter's module owns, and the wrapper that adds the adapters' products.

The decoder fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
(engine/models/decoder.py); PEFT trains them apart. A wrapped projection
keeps one A per slot with the slices' A stacked along the rank (one shrink
for all of them) and one B per slice, which adds into the slice's columns:

    qkv_proj     -> q_proj [0, q), k_proj [q, q+kv), v_proj [q+kv, q+2kv)
    gate_up_proj -> gate_proj [0, i), up_proj [i, 2i)
    o_proj, down_proj -> themselves

Under tensor parallelism each rank holds its shard of the base layer, and of
the adapters the same way (``shard``): column-parallel projections (q/k/v,
gate/up) keep their rows of B and all of A; row-parallel ones (o, down) their
columns of A and all of B, so the partial products sum in the all-reduce that
follows the base layer, as its partial outputs do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.mlp import GatedMLP
from engine.lora.punica import LoRABatch, expand, shrink
from engine.tp_layout import TPLayout


@dataclass(slots=True, frozen=True)
class LoRASlice:
    module: str  # PEFT's module name
    offset: int  # first output column in the fused projection (this rank's)
    size: int  # output columns (this rank's)


class LoRAContext:
    """The step's adapter rows, shared by every wrapped projection (the model
    runner sets ``batch`` before a forward; None: no row has an adapter)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """A projection plus the adapters of the step's tokens."""

    def __init__(
        self,
        base: nn.Module,
        slices: tuple[LoRASlice, ...],
        ctx: LoRAContext,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.max_rank = max_rank
        self._ctx = ctx
        device = base.weight.device
        in_features = base.weight.shape[1]
        shape_a = (max_loras, len(slices) * max_rank, in_features)
        self.register_buffer("lora_a", torch.zeros(shape_a, dtype=dtype, device=device), False)
        self.lora_b = [
            torch.zeros(max_loras, s.size, max_rank, dtype=dtype, device=device) for s in slices
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self._ctx.batch
        if batch is None:
            return y
        u = shrink(x, self.lora_a, batch)
        r = self.max_rank
        for i, s in enumerate(self.slices):
            expand(y, u[:, i * r : (i + 1) * r], self.lora_b[i], batch, s.offset)
        return y

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's (sharded) A and B of each slice in ``slot`` (zeros
        for the slices it does not train)."""
        r = self.max_rank
        self.lora_a[slot].zero_()
        for i, s in enumerate(self.slices):
            self.lora_b[i][slot].zero_()
            pair = weights.get(s.module)
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            self.lora_a[slot, i * r : i * r + rank].copy_(a)
            self.lora_b[i][slot, :, :rank].copy_(b)


def shard(layout: TPLayout, module: str, a: torch.Tensor, b: torch.Tensor):
    """This rank's part of a module's A ``[r, in]`` and B ``[out, r]``."""
    if layout.size == 1:
        return a, b
    d = layout.head_dim
    if module == "q_proj":
        heads = layout.q_heads
        return a, b[heads.start * d : heads.stop * d]
    if module in ("k_proj", "v_proj"):
        heads = layout.kv_heads
        return a, b[heads.start * d : heads.stop * d]
    if module in ("gate_proj", "up_proj"):
        rows = layout.intermediate_range
        return a, b[rows.start : rows.stop]
    if module == "o_proj":
        heads = layout.q_heads
        return a[:, heads.start * d : heads.stop * d], b
    rows = layout.intermediate_range  # down_proj
    return a[:, rows.start : rows.stop], b


def wrap_model(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype
) -> tuple[LoRAContext, list[tuple[int, LoRALinear]]]:
    """Replace the projections of every layer by LoRA wrappers (weights kept);
    returns the shared context and (layer, wrapper) pairs."""
    ctx = LoRAContext()
    wrapped: list[tuple[int, LoRALinear]] = []

    def wrap(owner: nn.Module, attr: str, layer: int, slices: tuple[LoRASlice, ...]) -> None:
        lora = LoRALinear(getattr(owner, attr), slices, ctx, max_loras, max_rank, dtype)
        setattr(owner, attr, lora)
        wrapped.append((layer, lora))

    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, kv = attn.q_size, attn.kv_size
        qkv = (LoRASlice("q_proj", 0, q), LoRASlice("k_proj", q, kv))
        wrap(attn, "qkv_proj", i, (*qkv, LoRASlice("v_proj", q + kv, kv)))
        wrap(attn, "o_proj", i, (LoRASlice("o_proj", 0, attn.o_proj.weight.shape[0]),))
        mlp = layer.mlp
        if isinstance(mlp, GatedMLP):  # an MoE layer's experts take no adapter
            inter = mlp.down_proj.weight.shape[1]
            gate_up = (LoRASlice("gate_proj", 0, inter), LoRASlice("up_proj", inter, inter))
            wrap(mlp, "gate_up_proj", i, gate_up)
            wrap(mlp, "down_proj", i, (LoRASlice("down_proj", 0, mlp.down_proj.weight.shape[0]),))
    return ctx, wrapped
