"""The `flash_attn` backend: FlashAttention-4 (CuTe DSL, Hopper/Blackwell) or FlashAttention-2.

FA4's ``flash_attn.cute.flash_attn_varlen_func`` takes the paged cache directly
(``page_table``, ``seqused_k``) for prefill, prefill over a cached prefix and
decode alike, with pages of 16 to 256 tokens. FA2's ``flash_attn_varlen_func``
/ ``flash_attn_with_kvcache`` take a ``block_table`` but need pages that are a
multiple of 256 tokens. New K/V are written into the cache by the Triton store
kernel (or torch where Triton is missing) before attention runs.

Install with ``pip install 'pdserve[flash-attn]'`` (FA4) where wheels exist.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.layers.attention.backend import (
    AttentionBackend,
    AttentionBackendName,
    AttentionMetadata,
)

logger = logging.getLogger(__name__)

FA2_PAGE_MULTIPLE = 256


def _load_fa4() -> Any | None:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # ImportError, or a CUDA/CuTe runtime mismatch at import
        return None
    return flash_attn_varlen_func


def _load_fa2() -> tuple[Any, Any] | None:
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except Exception:
        return None
    return flash_attn_varlen_func, flash_attn_with_kvcache


def flash_attn_version(device: torch.device) -> int | None:
    """4 or 2 for the FlashAttention that can run on ``device``, else None."""
    if device.type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9 and _load_fa4() is not None:
        return 4
    if major >= 8 and _load_fa2() is not None:
        return 2
    return None


class FlashAttention(AttentionBackend):
    name = AttentionBackendName.FLASH_ATTN
    supports_cuda_graphs = True

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, block_size) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        device = torch.device("cuda", torch.cuda.current_device())
        self.version = flash_attn_version(device)
        if self.version == 4:
            self._fa4 = _load_fa4()
        elif self.version == 2:
            if block_size % FA2_PAGE_MULTIPLE:
                raise ValueError(
                    f"kvcache_block_size {block_size} does not work with FlashAttention-2, "
                    f"whose paged KV needs blocks that are a multiple of {FA2_PAGE_MULTIPLE} "
                    "tokens; use kvcache_block_size=256 or attention_backend='triton'"
                )
            self._fa2_varlen, self._fa2_kvcache = _load_fa2()
        else:  # pragma: no cover - select_backend checks availability first
            raise ValueError("flash_attn is not available on this device")
        self._store = _store_kv_function()

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return "it needs a CUDA GPU"
        if dtype not in (torch.float16, torch.bfloat16):
            return (
                f"FlashAttention needs float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
            )
        if flash_attn_version(device) is None:
            return (
                "neither FlashAttention-4 (flash_attn.cute) nor FlashAttention-2 is importable "
                "(pip install 'pdserve[flash-attn]')"
            )
        return None

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, kv_stored: bool = False
    ) -> torch.Tensor:
        if not kv_stored:
            self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        if self.version == 4:
            out, _ = self._fa4(
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=meta.query_start_loc,
                seqused_k=meta.seq_lens,
                page_table=meta.block_tables,
                max_seqlen_q=meta.max_query_len,
                softmax_scale=self.scale,
                causal=True,
            )
            return out
        if meta.is_decode_only:
            out = self._fa2_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=self.scale,
                causal=True,
            )
            return out.squeeze(1)
        cu_seqlens_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
        torch.cumsum(meta.seq_lens, 0, out=cu_seqlens_k[1:])
        return self._fa2_varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_tables,
        )


def _store_kv_function():
    try:
        from engine.layers.attention.triton_kernels import store_kv

        return store_kv
    except ImportError:
        from engine.layers.attention.torch_backend import write_kv

        return write_kv
