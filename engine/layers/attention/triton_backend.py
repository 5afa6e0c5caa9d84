"""The `triton` backend: our own paged-attention kernels (store and prefill in
triton_kernels.py, split-K decode in triton_decode.py)."""

from __future__ import annotations

import os

import torch

from engine.layers.attention.backend import (
    AttentionBackend,
    AttentionBackendName,
    AttentionMetadata,
)


def interpreter_enabled() -> bool:
    """Triton's interpreter runs kernels on the CPU (slowly): used by CI tests."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonAttention(AttentionBackend):
    name = AttentionBackendName.TRITON
    supports_cuda_graphs = True
    accepts_out = True

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, block_size) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        from engine.layers.attention import triton_decode, triton_kernels

        self._kernels = triton_kernels
        self._decode = triton_decode
        self._num_sms: int | None = None

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda" and not interpreter_enabled():
            return "it needs a CUDA GPU (or TRITON_INTERPRET=1 for tests)"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "the triton package is not installed"
        return None

    def num_splits(self, meta: AttentionMetadata, device: torch.device, num_seqs: int) -> int:
        if meta.decode_num_splits is not None:
            return meta.decode_num_splits  # fixed when a CUDA graph was captured
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else 4
            )
        return self._decode.decode_num_splits(
            num_seqs, self.num_kv_heads, meta.max_seq_len, self._num_sms
        )

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        kv_stored: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kern = self._kernels
        if not kv_stored:
            kern.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        # Decode rows (one query token each) lead the batch: the split-K decode
        # kernel serves them, the prefill kernel only the rows after them.
        d = meta.num_seqs if meta.is_decode_only else meta.num_decode_seqs
        if d:
            self._decode.decode_attention(
                q[:d],
                k_cache,
                v_cache,
                out[:d],
                meta.block_tables[:d],
                meta.seq_lens[:d],
                self.scale,
                self.num_splits(meta, q.device, d),
            )
        if d < meta.num_seqs:
            kern.prefill_attention(
                q[d:],
                k_cache,
                v_cache,
                out[d:],
                meta.block_tables[d:],
                meta.query_start_loc[d:] - d if d else meta.query_start_loc,
                meta.seq_lens[d:],
                meta.max_query_len,
                self.scale,
            )
        return out
