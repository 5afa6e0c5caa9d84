"""The reference backend: plain torch, one scaled_dot_product_attention per sequence.

Runs on CPU and CUDA. It is the oracle the faster backends are tested against,
so it favours obviousness over speed. Soft-capped scores (Gemma) go through
an explicit softmax, in Hugging Face's order of operations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.attention.backend import (
    AttentionBackend,
    AttentionBackendName,
    AttentionMetadata,
)
from engine.layers.attention.kv_quant import dequantize, is_fp8, quantize, storage_view


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Store each new token's K and V at its cache slot (an FP8 cache: quantized
    by ``kv_scales``, ``[k_scale, v_scale]``)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if is_fp8(k_cache.dtype):
        k, v = quantize(k, kv_scales[0]), quantize(v, kv_scales[1])
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = storage_view(cache).view(-1, num_kv_heads, head_dim)
        rows.index_copy_(0, slot_mapping, storage_view(new))


def readable(cached: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache entries in the model's dtype (dequantized where FP8)."""
    return dequantize(cached, scale, dtype) if is_fp8(cached.dtype) else cached


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, [seq_len, num_kv_heads, head_dim].
    A freed block's entry (-1, before a sliding window) reads block 0: the caller
    masks those positions."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].clamp_min(0))
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    """[..., heads, q, dim] attention over [..., heads, k, dim] with a boolean mask
    (True: visible); hidden keys and values must be finite (zero them)."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class TorchAttention(AttentionBackend):
    name = AttentionBackendName.TORCH
    supports_sliding_window = True
    supports_soft_cap = True
    supports_fp8_kv = True

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        kv_stored: bool = False,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not kv_stored:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
        if meta.is_decode_only:
            return self._decode(
                q, (k_cache, v_cache), scales, meta, sliding_window, logits_soft_cap
            )
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        for i in range(meta.num_seqs):
            start, end = qsl[i], qsl[i + 1]
            query_len, seq_len = end - start, meta.seq_lens_cpu[i]
            keys = readable(gather_kv(k_cache, meta.block_tables[i], seq_len), scales[0], q.dtype)
            values = readable(gather_kv(v_cache, meta.block_tables[i], seq_len), scales[1], q.dtype)
            out[start:end] = self._attend(
                q[start:end], keys, values, query_len, seq_len, sliding_window, logits_soft_cap
            )
        return out

    def _decode(self, q, caches, scales, meta: AttentionMetadata, window, soft_cap) -> torch.Tensor:
        """One query per sequence: gather every context padded to the longest, mask the padding."""
        k_cache, v_cache = caches
        block_size = k_cache.shape[1]
        num_blocks = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:, :num_blocks].clamp_min(0)
        batch, ctx = meta.num_seqs, num_blocks * block_size
        # [batch, blocks, block_size, kv_heads, dim] -> [batch, kv_heads, ctx, dim]
        keys = readable(k_cache[tables], scales[0], q.dtype)
        values = readable(v_cache[tables], scales[1], q.dtype)
        keys = keys.reshape(batch, ctx, self.num_kv_heads, -1).transpose(1, 2)
        values = values.reshape(batch, ctx, self.num_kv_heads, -1).transpose(1, 2)
        pos = torch.arange(ctx, device=q.device)[None, :]
        valid = pos < meta.seq_lens[:, None]
        if window is not None:
            valid &= pos >= meta.seq_lens[:, None] - window
        # Padding slots hold whatever the cache memory held (possibly NaN bit
        # patterns): masking their scores is not enough, since 0 * NaN = NaN.
        pad = ~valid[:, None, :, None]
        keys = keys.masked_fill(pad, 0.0)
        values = values.masked_fill(pad, 0.0)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        out = attend(q.unsqueeze(2), keys, values, valid[:, None, None, :], self.scale, soft_cap)
        return out.squeeze(2)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        query_len: int,
        seq_len: int,
        window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        # [tokens, heads, dim] -> [heads, tokens, dim]
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        mask = None
        if query_len > 1 or window is not None:
            # Bottom-right causal: new token i sits at position seq_len - query_len + i.
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
                # Keys before every query's window may be freed blocks (garbage).
                seen = (k_pos[0] > seq_len - query_len - window)[None, :, None]
                k = k.masked_fill(~seen, 0.0)
                v = v.masked_fill(~seen, 0.0)
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
        out = attend(q, k, v, mask, self.scale, soft_cap)
        return out.transpose(0, 1)
