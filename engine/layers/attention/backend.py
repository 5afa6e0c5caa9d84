"""The attention-backend interface every backend (torch, triton, flash_attn) implements.

Contract:
- The KV cache of one layer is two tensors, ``k_cache`` and ``v_cache``, each
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` (the paged layout that
  FlashAttention's ``page_table`` / ``block_table`` arguments expect). Token
  ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
  ``t % block_size``; its flat *slot* is ``block * block_size + offset``.
- One forward call covers a mixed batch: every sequence contributes
  ``query_len`` new tokens (a prompt, a chunk of one, or a single decode token)
  on top of ``seq_len - query_len`` tokens already in the cache. Attention is
  causal, aligned to the bottom right (new token i sees the cached prefix and
  new tokens 0..i).
- ``forward`` first writes the new tokens' K and V into their slots, then attends;
  with ``kv_stored=True`` the caller has written them already (the fused RoPE
  kernel stores k after rotating it, saving a launch).
- Per layer (vLLM's names): ``sliding_window`` W lets a query at position p
  see the keys at positions p - W + 1 .. p only (Hugging Face's window: W
  tokens, itself included); the blocks of a sequence wholly before its
  queries' windows may be freed (block table entry -1) and are never read.
  ``logits_soft_cap`` c replaces each scaled score s by c * tanh(s / c).
  A backend that lacks one says so (``supports_sliding_window``,
  ``supports_soft_cap``) and ``auto`` skips it for models that need it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.layers.specs import AttentionBackendName


@dataclass(slots=True)
class AttentionMetadata:
    """Where one forward's tokens come from and go to. Tensors live on the model's device."""

    num_seqs: int
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including the new tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies for backends that loop in Python (the torch reference).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Split-K factor for decode kernels, fixed when a CUDA graph is captured
    # (None: the backend picks one per step).
    decode_num_splits: int | None = None
    # Leading sequences with one query token each: the scheduler puts running
    # decodes first, so a mixed step is decodes then prefills. Backends with a
    # decode kernel run it on these rows and the prefill kernel on the rest
    # (a prefill kernel gives each decode row a whole query tile and reads its
    # KV once per query head instead of once per KV head).
    num_decode_seqs: int = 0

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    name: ClassVar[AttentionBackendName]
    # True when the decode path reads nothing from the host (no Python loop
    # over host lists), so a CUDA graph can capture it.
    supports_cuda_graphs: ClassVar[bool] = False
    # True when ``forward`` takes ``out=`` (a [num_tokens, num_heads, head_dim]
    # tensor to write the result into; the piecewise CUDA graphs' static buffer).
    accepts_out: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_soft_cap: ClassVar[bool] = False
    # True when ``forward`` reads and writes an FP8 cache, given ``kv_scales``
    # ([k_scale, v_scale], float32): entries are stored as value / scale.
    supports_fp8_kv: ClassVar[bool] = False

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """None if this backend can run on ``device`` in ``dtype``, else a one-line reason."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_stored: bool = False,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

    @classmethod
    def missing_features(cls, sliding_window: bool, soft_cap: bool) -> str | None:
        """None if this backend runs a model with these features, else what it lacks."""
        lacks = []
        if sliding_window and not cls.supports_sliding_window:
            lacks.append("sliding-window attention")
        if soft_cap and not cls.supports_soft_cap:
            lacks.append("attention logit soft-capping")
        return f"it lacks {' and '.join(lacks)}" if lacks else None
