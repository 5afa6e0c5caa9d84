"""Weights offload (vLLM's ``cpu_offload_gb``): some decoder layers' weights
live in host memory and are copied to the device just before the layer runs,
so a model somewhat larger than the device fits, at the cost of the copies.

Whole layers are taken from the first, while their parameters fit the budget.
The life of an offloaded layer's parameters:

1. built on the device and at once moved to host memory (pinned on CUDA,
   which lets copies run asynchronously and be captured by CUDA graphs), so the
   device never holds more than the resident weights and one layer; the
   checkpoint is then loaded into the host copies (``adopt``);
2. once loaded, each parameter points at a device buffer shared by every
   offloaded layer of the same shapes: layers run one after another, so one
   set of buffers per shape is enough (``attach``);
3. before layer i runs, its host copies are written into those buffers on the
   current stream (``load``). Eager steps and CUDA-graph captures both call it;
   a captured copy reads the same pinned host memory again at every replay, so
   graphs stay on and stay correct.

On a CPU the same steps run (a CPU-to-CPU copy): that is how CI tests it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.device import GiB

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _OffloadedLayer:
    host: list[torch.Tensor]  # the layer's parameters, in host memory
    device: list[torch.Tensor]  # the shared device buffers they are copied into


class WeightOffloader:
    """The offloaded layers of one model (one tensor-parallel rank's shard:
    ``cpu_offload_gb`` is per rank, as vLLM's is per GPU)."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.budget_bytes = budget_bytes
        self.device = device
        self.offloaded_bytes = 0
        # Host-to-device layer copies issued from Python: eager forwards and graph
        # captures (a graph replay copies again without passing through here).
        self.num_layer_loads = 0
        self._adopted: dict[int, nn.Module] = {}
        self._layers: dict[int, _OffloadedLayer] = {}
        self._closed = False  # a layer did not fit: the later ones stay resident

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self._adopted)

    def adopt(self, index: int, layer: nn.Module) -> nn.Module:
        """Layer ``index``, just built: its parameters into host memory if they
        still fit the budget (layers are offered in order, from the first)."""
        nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        if self._closed or self.offloaded_bytes + nbytes > self.budget_bytes:
            self._closed = True
            return layer
        pin = self.device.type == "cuda"
        for p in layer.parameters():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            p.data = host.copy_(p.data)
        self.offloaded_bytes += nbytes
        self._adopted[index] = layer
        return layer

    def attach(self) -> None:
        """After loading: every offloaded parameter points at its device buffer,
        its host copy kept apart for ``load``."""
        shared: dict[tuple, list[torch.Tensor]] = {}
        for index, layer in self._adopted.items():
            params = list(layer.parameters())
            shape = tuple((tuple(p.shape), p.dtype) for p in params)
            if shape not in shared:
                shared[shape] = [torch.empty_like(p, device=self.device) for p in params]
            buffers = shared[shape]
            self._layers[index] = _OffloadedLayer([p.data for p in params], buffers)
            for p, buf in zip(params, buffers, strict=True):
                p.data = buf
        if self._layers:
            logger.info(
                "weights offload: layers %s (%.2f GiB) stream from host memory through %d "
                "set(s) of device buffers",
                ",".join(map(str, self.layer_indices)),
                self.offloaded_bytes / GiB,
                len(shared),
            )

    def load(self, index: int) -> None:
        """Layer ``index``'s weights into its device buffers (no-op if resident)."""
        layer = self._layers.get(index)
        if layer is None:
            return
        for buf, host in zip(layer.device, layer.host, strict=True):
            buf.copy_(host, non_blocking=True)
        self.num_layer_loads += 1
