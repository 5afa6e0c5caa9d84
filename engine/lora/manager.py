"""The model runner's side of LoRA: adapters in host memory, copies into the
device slots the scheduler assigned, and each step's per-token slots.

Host cache: up to ``max_cpu_loras`` adapters, least recently used evicted
first; an evicted adapter is read from its directory again when a request
needs it (the same files: their digest, which keys the request's block
hashes, is checked). Device slots: the scheduler's ``LoRASlots`` says which
adapter a slot holds; before a step this copies the weights of any adapter
that is not in its slot yet (the slot was free or idle, so no step in flight
reads it: on a GPU the copy is ordered after earlier steps on the stream).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence as Seqs

import numpy as np
import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from engine.lora.config import LoRADType
from engine.lora.layers import shard, wrap_model
from engine.lora.punica import LoRABatch
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRASlots
from engine.models.config import ModelArchConfig
from engine.parallel.handoff import StepPlan
from engine.tp_layout import TPLayout

logger = logging.getLogger(__name__)

_DTYPES = {
    LoRADType.FLOAT16: torch.float16,
    LoRADType.BFLOAT16: torch.bfloat16,
    LoRADType.FLOAT32: torch.float32,
}


class LoRAManager:
    def __init__(
        self,
        config,  # engine.config.EngineConfig
        model: nn.Module,
        layout: TPLayout,
        device: torch.device,
        model_dtype: torch.dtype,
        use_triton: bool,
    ) -> None:
        self.arch: ModelArchConfig = config.model_config
        self.max_lora_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        self.dtype = _DTYPES.get(config.lora_dtype, model_dtype)
        self.layout = layout
        self.device = device
        self.use_triton = use_triton
        self.ctx, self.wrapped = wrap_model(
            model, config.max_loras, config.max_lora_rank, self.dtype
        )
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # Every adapter this engine was asked for: its request and digest.
        self.known: dict[int, tuple[LoRARequest, str]] = {}
        self.in_slot: list[int | None] = [None] * config.max_loras
        self.num_slot_loads = 0  # copies into device slots (tests, metrics)
        # What CUDA graphs capture: every token's slot read from one buffer as
        # long as the largest step, -1 where a row has no adapter.
        self.graph_batch: LoRABatch | None = None
        self._graph_dirty = False
        if use_triton:
            rows = max(config.max_num_batched_tokens, config.max_num_seqs)
            buffer = torch.full((rows,), -1, dtype=torch.int32, device=device)
            self.graph_batch = LoRABatch(buffer, (), use_triton=True)

    def register(self, request: LoRARequest) -> str:
        """Check a request's adapter (reading it on first sight); its digest."""
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known[0] != request:
                raise LoRAAdapterError(
                    f"lora_int_id {request.lora_int_id} is adapter {known[0].lora_name!r} at "
                    f"{known[0].lora_path!r}; got {request.lora_name!r} at "
                    f"{request.lora_path!r}"
                )
            return known[1]
        adapter = self._host_adapter(request)
        self.known[request.lora_int_id] = (request, adapter.digest)
        return adapter.digest

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.host.pop(request.lora_int_id, None)
        if adapter is None:
            adapter = load_adapter(request, self.arch, self.max_lora_rank, self.dtype)
            known = self.known.get(request.lora_int_id)
            if known is not None and known[1] != adapter.digest:
                raise LoRAAdapterError(
                    f"LoRA adapter {request.lora_name!r} changed on disk since it was first "
                    "loaded: its requests' cached KV would not match; load it under a new id"
                )
            logger.info("LoRA adapter %r read (rank %d)", request.lora_name, adapter.rank)
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def load_slot(self, slot: int, request: LoRARequest) -> None:
        """Copy an adapter into a device slot unless it is there already."""
        if self.in_slot[slot] == request.lora_int_id:
            return
        adapter = self._host_adapter(request)
        by_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), (a, b) in adapter.weights.items():
            by_layer.setdefault(layer, {})[module] = shard(self.layout, module, a, b)
        with torch.no_grad():
            for layer, lora in self.wrapped:
                lora.set_slot(slot, by_layer.get(layer, {}))
        self.in_slot[slot] = request.lora_int_id
        self.num_slot_loads += 1

    def plan_step(
        self,
        plan: StepPlan,
        requests: Seqs[LoRARequest | None],
        num_new: Seqs[int],
        slots: LoRASlots,
    ) -> None:
        """Fill the plan's per-token slots (int32, -1: none; None when no
        sequence has an adapter) and the (slot, adapter) copies the step needs
        first (``begin_step``, on every rank)."""
        if all(r is None for r in requests):
            return
        seq_slots = np.full(len(requests), -1, dtype=np.int32)
        loads: dict[int, LoRARequest] = {}
        for i, request in enumerate(requests):
            if request is not None:
                seq_slots[i] = slot = slots.slot_of(request.lora_int_id)
                if self.in_slot[slot] != request.lora_int_id:
                    loads[slot] = request
        plan.lora_slots = np.repeat(seq_slots, np.asarray(num_new, dtype=np.int64))
        plan.lora_loads = list(loads.items())

    @property
    def in_graphs(self) -> bool:
        """Whether CUDA graphs capture the LoRA products (the Triton kernels
        read each token's slot from ``graph_batch``'s buffer, a graph input)."""
        return self.graph_batch is not None

    def begin_step(self, plan: StepPlan, slots_dev: torch.Tensor | None, graph: bool) -> None:
        """Copy the step's new adapters into their slots, then give the wrapped
        projections the step's adapter rows (``slots_dev``: ``plan.lora_slots``
        on the device): for an eager forward as the context's batch; for a
        graph replay in the captured slot buffer (-1 beyond the step's rows)."""
        for slot, request in plan.lora_loads:  # every rank copies its shard
            self.load_slot(slot, request)
        slots = plan.lora_slots
        if graph:
            buffer = self.graph_batch.token_slots
            if slots is not None:
                buffer[: len(slots)].copy_(slots_dev)
                buffer[len(slots) :].fill_(-1)
                self._graph_dirty = True
            elif self._graph_dirty:
                buffer.fill_(-1)
                self._graph_dirty = False
            self.ctx.batch = None
        elif slots is not None:
            self.ctx.batch = LoRABatch.build(slots, slots_dev, self.use_triton)

    def end_step(self) -> None:
        self.ctx.batch = None
