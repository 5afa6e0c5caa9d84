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
        self._args_meta: AttentionMetadata | None = None
        self._args = None

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
        d, splits, decode_args, prefill_args = self._step_args(meta, q.device)
        if d:
            self._decode.decode_attention(
                q[:d], k_cache, v_cache, out[:d], *decode_args, self.scale, splits
            )
        if prefill_args is not None:
            kern.prefill_attention(
                q[d:], k_cache, v_cache, out[d:], *prefill_args, meta.max_query_len, self.scale
            )
        return out

    def _step_args(self, meta: AttentionMetadata, device: torch.device):
        """What every layer of one step passes alike (the decode rows, the split
        count, the metadata's slices): worked out at the step's first layer, not
        at each (a slice is a few microseconds of host time, the prefill's shifted
        query starts a launch)."""
        if self._args_meta is meta:
            return self._args
        # Decode rows (one query token each) lead the batch: the split-K decode
        # kernel serves them, the prefill kernel only the rows after them.
        d = meta.num_seqs if meta.is_decode_only else meta.num_decode_seqs
        splits = self.num_splits(meta, device, d) if d else 0
        decode_args = (meta.block_tables[:d], meta.seq_lens[:d]) if d else None
        prefill_args = None
        if d < meta.num_seqs:
            prefill_args = (
                meta.block_tables[d:],
                meta.query_start_loc[d:] - d if d else meta.query_start_loc,
                meta.seq_lens[d:],
            )
        # The metadata is kept with them, so a new step's cannot reuse its id.
        self._args_meta = meta
        self._args = (d, splits, decode_args, prefill_args)
        return self._args
