"""Decoder-only transformer covering LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.

The three differ only in facts read from config.json (ModelArchConfig): Qwen2
has biases on q/k/v, Qwen3 normalises q and k per head before RoPE, Llama may
have neither. Projections are fused (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) so each layer runs two fewer matmuls; the loader splits the
checkpoint's separate tensors into them.
"""

from __future__ import annotations

import torch
from torch import nn

from common.layers.activation import SiluAndMul
from common.layers.attention import AttentionBackend, AttentionMetadata
from common.layers.norm import RMSNorm
from common.layers.rotary import RotaryEmbedding
from common.models.config import ModelArchConfig


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        # Shared, not owned: registering them as submodules would duplicate them.
        self._rotary = (rotary,)
        self.backend = backend
        # Set by the model runner once the KV cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self._rotary[0](positions, q, k)
        out = self.backend.forward(q, k, v.contiguous(), self.k_cache, self.v_cache, meta)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary, backend) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden_size]."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
