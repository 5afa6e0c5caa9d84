"""Piecewise CUDA graphs for steps with prefill rows in them ("mixed" steps).

A decode-only step replays one graph of the whole model (engine/cuda_graphs.py).
A step with a prefill row in it cannot: its attention's shape (query lengths,
the prefill kernel's grid) changes every step. Run eagerly, a step of an 8B
model is bound by the host (about 200 Triton launches through Triton's Python
launcher and 128 torch linear calls,
docs/lab/2026-11-25-shared-prefix-steps-slower.md), so this captures
everything *between* the attention calls, per padded token count, and runs
only attention eagerly (vLLM's "piecewise" graphs):

- piece 0: embedding, layer 0's input norm, qkv projection and RoPE (fused:
  with the KV-cache store);
- piece i (1..L-1): layer i-1's o_proj, post-attention norm and MLP, layer
  i's input norm, qkv projection and RoPE (+ store);
- piece L: the last layer's o_proj, norm and MLP, and the final norm.

A step of ``T`` tokens (decodes first, then prefill rows) replays the graphs of
the smallest captured size ``n >= T``. The pieces read and write static
buffers (token ids, positions, slots, the residual stream, q/k/v, the
attention output, the final hidden states); between two pieces the layer's
attention runs eagerly on the first ``T`` rows only, with the step's own
(unpadded) metadata. Padding rows ``T..n`` keep stale token ids and positions
(valid indices) and get ``slot = -1``, so the store never writes them; every
captured op is row-wise, so they cannot reach the real rows. The real rows
can differ from an eager step's in the last bits: cuBLAS may pick another
GEMM algorithm for ``n`` rows than for ``T`` (a greedy run splits only at
near-ties).

One graph memory pool serves all pieces of all sizes (captured largest first;
pieces replay in capture order). On by default (``piecewise_cuda_graphs``);
single-rank only (with tensor parallelism every rank would have to pad alike).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.config import EngineConfig
from engine.layers.attention import AttentionBackend
from engine.model_io import ModelInputs

logger = logging.getLogger(__name__)

# Padded token counts: fine steps where a step's matmuls are bound by reading
# the weights (padding is almost free), coarser above.
PIECEWISE_SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def piecewise_sizes(max_tokens: int, cap: int = PIECEWISE_SIZES[-1]) -> list[int]:
    top = min(max_tokens, cap)
    sizes = [s for s in PIECEWISE_SIZES if s <= top]
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sizes


def piecewise_graphs_for(
    config: EngineConfig,
    model: nn.Module,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp_size: int,
) -> PiecewiseGraphs | None:
    """The graphs a model runner should use, or None (and why, in the log)."""
    if device.type != "cuda" or config.enforce_eager or not config.piecewise_cuda_graphs:
        return None
    if tp_size > 1:
        logger.info("piecewise CUDA graphs are off: single-rank only for now")
        return None
    if not backend.accepts_out:
        # Measured and tested with triton only; the copy path is not.
        logger.info("piecewise CUDA graphs are off with the %s backend", backend.name.value)
        return None
    return PiecewiseGraphs(model, device, dtype, piecewise_sizes(config.max_num_batched_tokens))


class PiecewiseGraphs:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, sizes) -> None:
        self.model = model
        self.device = device
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        layers = model.layers
        self.num_layers = len(layers)
        attn = layers[0].self_attn
        self.fused = attn.store_in_rope  # K/V stored by the projection piece
        n = self.max_tokens
        cfg = model.config
        z = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, **z)
        self.positions = torch.zeros(n, dtype=torch.int64, **z)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **z)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=torch.float32, **z)
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, **z)
        # Unfused, the eager attention stores K/V itself: it needs them too.
        kv_shape = (n, attn.num_kv_heads, attn.head_dim)
        self.k = None if self.fused else torch.zeros(kv_shape, dtype=dtype, **z)
        self.v = None if self.fused else torch.zeros(kv_shape, dtype=dtype, **z)
        self.attn_out = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, **z)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, **z)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._capture_all()

    # ----------------------------------------------------------- the pieces
    def _piece(self, i: int, n: int) -> None:
        """Piece ``i`` on the first ``n`` rows of the static buffers."""
        model = self.model
        if i == 0:
            x = model.embed_tokens(self.input_ids[:n])
            # fp32 residual stream, as DecoderLayer.forward keeps it.
            residual = x.to(torch.float32)
            model.load_layer(0)
            x = model.layers[0].input_layernorm(x)
        else:
            layer = model.layers[i - 1]
            x = layer.self_attn.output(self.attn_out[:n])
            x, residual = layer.after_attention(x, self.residual[:n])
            if i == self.num_layers:
                x, _ = model.norm(x, residual)
                self.hidden[:n].copy_(x)
                return
            # Offloaded weights (cpu_offload_gb): layer i's may replace layer
            # i - 1's in a shared buffer, so only once that layer is done.
            model.load_layer(i)
            x, residual = model.layers[i].input_layernorm(x, residual)
        self.residual[:n].copy_(residual)
        q, k, v = model.layers[i].self_attn.project(self.positions[:n], x, self.slot_mapping[:n])
        self.q[:n].copy_(q)
        if not self.fused:
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = None
        pieces = range(self.num_layers + 1)
        # Largest first, so the smaller sizes' temporaries fit in the pool it leaves.
        for n in reversed(self.sizes):
            for i in pieces:  # warm-up (and any kernel compilation)
                self._piece(i, n)
            torch.cuda.synchronize()
            graphs = []
            for i in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._piece(i, n)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[n] = graphs
        torch.cuda.synchronize()
        logger.info(
            "captured piecewise CUDA graphs (%d pieces) for mixed steps of %s tokens in %.1f s",
            self.num_layers + 1,
            ",".join(map(str, self.sizes)),
            time.perf_counter() - start,
        )

    # ---------------------------------------------------------------- steps
    def can_run(self, inputs: ModelInputs) -> bool:
        return 0 < inputs.meta.num_tokens <= self.max_tokens

    def run(
        self, inputs: ModelInputs, after_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """The step's hidden states after the final norm, [T, hidden] (a view of a
        static buffer: the next step overwrites it). ``after_layer(i)`` (a KV
        observer, engine/kv_writes.py) runs once layer i is issued, as in an eager
        step: after the piece that ends it (its o_proj and MLP, which also runs
        layer i + 1's projection and KV store), so layer i's KV is written
        whichever backend stores it."""
        meta = inputs.meta
        t = meta.num_tokens
        n = next(s for s in self.sizes if s >= t)
        self.input_ids[:t].copy_(inputs.input_ids)
        self.positions[:t].copy_(inputs.positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        if n > t:
            # Stale ids and positions are valid indices; a stale slot would overwrite a real one.
            self.slot_mapping[t:n].fill_(-1)
        graphs = self.graphs[n]
        q = self.q[:t]
        k = self.k[:t] if self.k is not None else None
        v = self.v[:t] if self.v is not None else None
        out = self.attn_out[:t]
        graphs[0].replay()
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attend(q, k, v, meta, out=out)
            graphs[i + 1].replay()
            if after_layer is not None:
                after_layer(i)
        return self.hidden[:t]
