"""The `triton` backend: our own paged-attention kernels (store and prefill in
triton_kernels.py, split-K decode in triton_decode.py, short-query prefill split
over the context in triton_prefill_split.py)."""

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
    supports_sliding_window = True
    supports_soft_cap = True
    supports_fp8_kv = True

    def __init__(self, num_heads, num_kv_heads, head_dim, scale, block_size) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        from engine.layers.attention import triton_decode, triton_kernels, triton_prefill_split

        self._kernels = triton_kernels
        self._decode = triton_decode
        self._split = triton_prefill_split
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

    def sm_count(self, device: torch.device) -> int:
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else 4
            )
        return self._num_sms

    def num_splits(self, meta: AttentionMetadata, device: torch.device, num_seqs: int) -> int:
        if meta.decode_num_splits is not None:
            return meta.decode_num_splits  # fixed when a CUDA graph was captured
        return self._decode.decode_num_splits(
            num_seqs, self.num_kv_heads, meta.max_seq_len, self.sm_count(device)
        )

    def prefill_splits(self, meta: AttentionMetadata, device: torch.device, d: int) -> int:
        """The prefill rows' context split (0: the unsplit kernel), from the host's
        lengths of those rows (a decode row's long context must not count)."""
        max_seq_len = max(meta.seq_lens_cpu[d:], default=meta.max_seq_len)
        return self._split.prefill_num_splits(
            meta.num_seqs - d,
            self.num_kv_heads,
            self.num_heads // self.num_kv_heads,
            meta.max_query_len,
            max_seq_len,
            self.sm_count(device),
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
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kern = self._kernels
        if not kv_stored:
            kern.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        if out is None:
            out = torch.empty_like(q)
        d, splits, decode_args, prefill_args, prefill_split = self._step_args(meta, q.device)
        if d:
            self._decode.decode_attention(
                q[:d],
                k_cache,
                v_cache,
                out[:d],
                *decode_args,
                self.scale,
                splits,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                kv_scales=kv_scales,
            )
        if prefill_args is not None:
            n, ws = prefill_split
            if sliding_window is not None or logits_soft_cap is not None:
                # The split prefill has neither (a sliding layer reads at most
                # a window of keys, so its context is short anyway).
                n, ws = 0, None
            kern.prefill_attention(
                q[d:],
                k_cache,
                v_cache,
                out[d:],
                *prefill_args,
                meta.max_query_len,
                self.scale,
                num_splits=n,
                workspace=ws,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                kv_scales=kv_scales,
            )
        return out

    def _step_args(self, meta: AttentionMetadata, device: torch.device):
        """What every layer of one step passes alike (the decode rows, the split
        counts, the metadata's slices, the split prefill's workspace): worked out
        at the step's first layer, not at each (a slice is a few microseconds of
        host time, the prefill's shifted query starts a launch)."""
        if self._args_meta is meta:
            return self._args
        # Decode rows (one query token each) lead the batch: the split-K decode
        # kernel serves them, the prefill kernel only the rows after them.
        d = meta.num_seqs if meta.is_decode_only else meta.num_decode_seqs
        splits = self.num_splits(meta, device, d) if d else 0
        decode_args = (meta.block_tables[:d], meta.seq_lens[:d]) if d else None
        prefill_args = None
        prefill_split = None
        if d < meta.num_seqs:
            prefill_args = (
                meta.block_tables[d:],
                meta.query_start_loc[d:] - d if d else meta.query_start_loc,
                meta.seq_lens[d:],
            )
            n = self.prefill_splits(meta, device, d)
            # One workspace for all layers: they run in turn on one stream.
            ws = (
                self._split.make_workspace(
                    meta.num_tokens - d, self.num_heads, self.head_dim, n, device
                )
                if n > 1
                else None
            )
            prefill_split = (n, ws)
        # The metadata is kept with them, so a new step's cannot reuse its id.
        self._args_meta = meta
        self._args = (d, splits, decode_args, prefill_args, prefill_split)
        return self._args
