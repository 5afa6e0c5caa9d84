"""CUDA graphs for decode steps: one graph per padded batch size, one shared memory pool.

A decode step of a small model is a few hundred kernel launches; replaying a
captured graph replaces them with one launch. Graphs are captured for batch
sizes 1, 2, 4, 8 and then every 16 up to ``max_num_seqs`` (at most 512); a step
of ``n`` sequences replays the smallest graph of at least ``n`` rows, with the
padding rows given ``slot = -1`` (the store kernel skips them) and
``seq_len = 0`` (attention reads nothing for them).

Everything the graph reads lives in static buffers that each step overwrites:
token ids, positions, slots, sequence lengths and block tables (as wide as
``max_model_len`` needs). The decode kernels' split-K factor is fixed per graph.
Only backends whose decode path reads nothing from the host can be captured
(triton, flash_attn); ``enforce_eager=True`` turns graphs off.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from engine.config import EngineConfig
from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.model_io import ModelInputs

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [s for s in (1, 2, 4, 8) if s <= top]
    sizes += list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        cfg: EngineConfig,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        # No reference to the runner: it owns this object, and a cycle would
        # keep a deleted engine's GPU memory alive until a gc pass.
        self.model = model
        self.backend = backend
        self.device = device
        self.max_model_len = cfg.max_model_len
        self.sizes = graph_batch_sizes(cfg.max_num_seqs)
        self.max_batch = self.sizes[-1]
        max_blocks = -(-cfg.max_model_len // cfg.kvcache_block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, cfg.model_config.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._metas: dict[int, AttentionMetadata] = {}
        self._capture_all()

    def _meta(self, batch: int) -> AttentionMetadata:
        backend = self.backend
        num_splits = None
        if hasattr(backend, "num_splits"):
            # Fixed per graph: sized for the longest context a replay may see.
            probe = AttentionMetadata(
                batch,
                batch,
                self.query_start_loc[: batch + 1],
                self.seq_lens[:batch],
                self.slot_mapping[:batch],
                self.block_tables[:batch],
                1,
                self.max_model_len,
                [],
                [],
            )
            num_splits = backend.num_splits(probe, self.device, batch)
        return AttentionMetadata(
            num_seqs=batch,
            num_tokens=batch,
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            decode_num_splits=num_splits,
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        model = self.model
        pool = None
        # Largest first, so the smaller graphs fit in the pool it leaves.
        for batch in reversed(self.sizes):
            meta = self._meta(batch)
            self._metas[batch] = meta
            args = (self.input_ids[:batch], self.positions[:batch], meta)
            self.hidden[:batch] = model(*args)  # warm-up (and any kernel compilation)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.hidden[:batch] = model(*args)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs for decode batches of 1..%d in %.1f s",
            len(self.graphs),
            self.max_batch,
            time.perf_counter() - start,
        )

    def can_run(self, inputs: ModelInputs) -> bool:
        return inputs.meta.is_decode_only and inputs.meta.num_seqs <= self.max_batch

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        meta = inputs.meta
        n = meta.num_seqs
        batch = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:batch].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:batch].fill_(0)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[batch].replay()
        return self.hidden[:n]
