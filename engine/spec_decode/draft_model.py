"""The draft model: a second, smaller model in the same engine that proposes
tokens greedily (vLLM's "draft_model" method).

Its paged KV cache has as many blocks as the target's and is indexed by the
same block tables, so the block manager, slot mappings and prefix cache
serve both; only the tensors differ. Its KV is valid for a sequence's first
``num_draft_computed_tokens`` positions, never past the target-verified ones
(``num_computed_tokens``): each proposal first catches up from there (a whole
prompt the first time, which is how a prompt prefilled on another node gets
its draft KV: computed here, on the decode node), then runs one token per
further proposed position. Proposals are the draft's argmax, so each is one
token and the target's check (engine/spec_decode/speculator.py) is exact.
A shared prefix-cache block's draft KV is recomputed by every sequence that
starts on it (a new sequence's draft starts at position 0): its target KV may
have landed from a prefill node, which computes no draft KV.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.device import default_dtype
from engine.layers.attention import select_backend
from engine.layers.specs import AttentionBackendName
from engine.models.config import ModelArchConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.loader import init_dummy_weights, load_weights
from engine.parallel.group import TPGroup
from engine.sequence import Sequence
from engine.step_inputs import HostStaging, host_inputs, to_model_inputs


class DraftModel:
    def __init__(
        self,
        model_dir: str,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
        backend: AttentionBackendName,
        dummy_weights_seed: int | None = None,
    ) -> None:
        self.cfg = cfg = ModelArchConfig.from_dir(model_dir)
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        backend_cls = select_backend(backend, device, dtype, cfg)
        self.attention_backend = backend_cls(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.softmax_scale,
            block_size,
        )  # fmt: skip
        with torch.device(device), default_dtype(dtype):
            model = DecoderForCausalLM(
                cfg, self.attention_backend, max_model_len, False, TPGroup.single(device),
                triton_moe=False,
            )  # fmt: skip
        if dummy_weights_seed is not None:  # the target has dummy weights: so has its draft
            init_dummy_weights(model, dummy_weights_seed)
        else:
            load_weights(model, model_dir)
        self.model = model.eval()
        self.staging = HostStaging(device)
        self.kv_cache: torch.Tensor | None = None

    @property
    def block_bytes(self) -> int:
        cfg = self.cfg
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return (
            2
            * cfg.num_hidden_layers
            * self.block_size
            * cfg.num_key_value_heads
            * (cfg.head_dim * elem)
        )

    def allocate_kv_cache(self, num_blocks: int) -> None:
        cfg = self.cfg
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        kv = alloc(
            2, cfg.num_hidden_layers, num_blocks, self.block_size, cfg.num_key_value_heads,
            cfg.head_dim, dtype=self.dtype, device=self.device,
        )  # fmt: skip
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache = kv[0, i]
            attn.v_cache = kv[1, i]
        self.kv_cache = kv

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """``k`` greedy tokens to follow each sequence. Its blocks must hold
        positions up to ``len(token_ids) + k - 2`` (the last proposed token is
        never an input)."""
        tables = [s.block_table for s in seqs]
        for s in seqs:
            s.num_draft_computed_tokens = min(s.num_draft_computed_tokens, s.num_computed_tokens)
        token_lists = [s.token_ids for s in seqs]
        starts = [s.num_draft_computed_tokens for s in seqs]
        counts = [len(s.token_ids) - start for s, start in zip(seqs, starts, strict=True)]
        proposals: list[list[int]] = [[] for _ in seqs]
        for j in range(k):
            tokens = self._next_tokens(token_lists, starts, counts, tables)
            for p, t in zip(proposals, tokens, strict=True):
                p.append(t)
            # The next step feeds each sequence's newest proposed token.
            token_lists = [s.token_ids + p for s, p in zip(seqs, proposals, strict=True)]
            starts = [len(s.token_ids) + j for s in seqs]
            counts = [1] * len(seqs)
        for s in seqs:  # its KV now covers every position but the last proposed
            s.num_draft_computed_tokens = len(s.token_ids) + k - 1
        return proposals

    def _next_tokens(
        self, token_lists: list[list[int]], starts: list[int], counts: list[int], tables
    ) -> list[int]:
        host = host_inputs(token_lists, starts, counts, tables, self.block_size)
        last = host.query_start_loc[1:] - 1
        inputs, (rows,) = to_model_inputs(host, self.staging, [last.astype(np.int64)])
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model.compute_logits(hidden[rows]).argmax(dim=-1).tolist()
