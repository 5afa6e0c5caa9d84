"""The model runner's side of LoRA: adapters in host memory, copies into the
device slots the scheduler assigned, and each step's per-token slots.

Host cache: up to ``max_cpu_loras`` adapters, least recently used evicted
first; an evicted adapter is read from its directory again when a request
needs it (the same files: their digest, which keys the request's block
hashes, is checked). Device slots: the scheduler's ``LoRASlots`` says which
adapter a slot holds; before a step this copies the weights of any adapter
that is not in its slot yet (the slot was free or idle, so no step in flight
reads it: on a GPU the copy is ordered after earlier steps on the stream).

Run-time changes: ``read`` checks and reads an adapter with no engine state
touched (another thread may call it, so the engine thread only files the
result: ``register(request, adapter)``); ``remove`` forgets an adapter for
new requests while the ones already queued or running keep its weights, and
``release`` frees its host copy and device slot once none is left (the
engine says when: ``LLMEngine.remove_lora``). An id keeps the digest it was
first read with for the engine's life, so re-adding a removed adapter with
other files under the same id is refused: tensor-parallel followers keep
their host copies by id, and their KV by that digest.
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
        # The adapters requests may name (add_lora, or a request's first
        # sight of one, less those removed since): request and digest.
        self.known: dict[int, tuple[LoRARequest, str]] = {}
        # The digest of every id ever read, removed ones included (module docstring).
        self.digests: dict[int, str] = {}
        # Removed adapters that queued or running requests still use: their
        # host copies stay (the host LRU skips them) until ``release``.
        self.removing: set[int] = set()
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

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter from disk, touching no state of this
        manager (any thread; LoRAAdapterError says what is wrong)."""
        return load_adapter(request, self.arch, self.max_lora_rank, self.dtype)

    def register(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> str:
        """Check a request's adapter (reading it on first sight, unless
        ``adapter`` is what ``read(request)`` gave); its digest."""
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if known[0] != request:
                raise LoRAAdapterError(
                    f"lora_int_id {request.lora_int_id} is adapter {known[0].lora_name!r} at "
                    f"{known[0].lora_path!r}; got {request.lora_name!r} at "
                    f"{request.lora_path!r}"
                )
            return known[1]
        adapter = self._host_adapter(request, adapter)
        self.known[request.lora_int_id] = (request, adapter.digest)
        self.removing.discard(request.lora_int_id)  # added again while draining
        return adapter.digest

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter for new requests (False: it was not known); the
        caller ``release``s it once no request uses it."""
        if self.known.pop(lora_int_id, None) is None:
            return False
        self.removing.add(lora_int_id)
        return True

    def release(self, lora_int_id: int, slots: LoRASlots) -> None:
        """Free a removed adapter's host copy and device slot (no request uses it)."""
        self.removing.discard(lora_int_id)
        self.host.pop(lora_int_id, None)
        slot = slots.drop(lora_int_id)
        if slot is not None and self.in_slot[slot] == lora_int_id:
            self.in_slot[slot] = None

    def _host_adapter(
        self, request: LoRARequest, adapter: LoRAAdapter | None = None
    ) -> LoRAAdapter:
        lora_int_id = request.lora_int_id
        if adapter is None:
            adapter = self.host.get(lora_int_id)
        if adapter is None:
            adapter = self.read(request)
            logger.info("LoRA adapter %r read (rank %d)", request.lora_name, adapter.rank)
        first = self.digests.setdefault(lora_int_id, adapter.digest)
        if first != adapter.digest:
            raise LoRAAdapterError(
                f"LoRA adapter {request.lora_name!r} (lora_int_id {lora_int_id}) differs "
                "from the files first read under that id: its requests' cached KV would not "
                "match; load it under a new id"
            )
        self.host.pop(lora_int_id, None)
        self.host[lora_int_id] = adapter  # the most recently used
        self._evict_host()
        return adapter

    def _evict_host(self) -> None:
        """Least recently used first; never the one just used, nor a removed
        adapter that requests still use (the cache may hold more meanwhile)."""
        over = len(self.host) - self.max_cpu_loras
        if over <= 0:
            return
        *older, _ = self.host
        for lora_int_id in [i for i in older if i not in self.removing][:over]:
            del self.host[lora_int_id]

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
        first (``begin_step``, on every rank).

        ``num_new``: each sequence's query positions in the step. A verifying
        sequence's count is ``1 + k`` (its last token and its proposal: the
        scheduler's ``num_new_tokens``), so all of them carry its adapter and
        every position the verify samples is the adapted model's."""
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
