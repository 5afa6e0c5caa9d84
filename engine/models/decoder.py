"""Decoder-only transformer covering every supported family (engine/models/families.py).

The families differ only in facts read from config.json (ModelArchConfig):
Qwen2 has biases on q/k/v, Qwen3 normalises q and k per head before RoPE,
Mistral's layers attend within a sliding window, Gemma3 interleaves sliding
and global layers (each with its own RoPE base), scales its embedding,
norms with (1 + w) before and after attention and the MLP, and may soft-cap
logits; the MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) replace the MLP of
their sparse layers by a mixture of experts (engine/layers/moe/).
Projections are fused (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) so each layer runs two fewer matmuls; the loader splits the
checkpoint's separate tensors into them. With ``fused_ops`` (CUDA), RMSNorm,
SiLU-and-mul and q/k-norm + RoPE run as single Triton kernels. The
projections are ``SkinnyLinear``: at a decode step's few tokens they may run
the skinny GEMM kernel instead of cuBLAS (engine/layers/skinny_gemm.py); under
FP8 quantization they are ``Fp8Linear`` (engine/quantization/fp8.py). With tensor
parallelism (``tp`` of several ranks) each rank builds its shard of every
layer (engine/tp_layout.py) and the collectives join them: an
all-reduce after o_proj and down_proj and after the embedding, an all-gather
of the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionBackend, AttentionMetadata
from engine.layers.mlp import GatedMLP
from engine.layers.moe.layer import FusedMoE
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.skinny_gemm import SkinnyLinear
from engine.models.config import ModelArchConfig
from engine.parallel.group import TPGroup
from engine.quantization.fp8 import linear_class
from engine.quantization.scheme import Quantization
from engine.tp_layout import TPLayout
from engine.weight_offload import WeightOffloader


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPGroup,
        layout: TPLayout,
        fused: bool = False,
        layer: int = 0,
        linear: type[nn.Module] = SkinnyLinear,  # the projections' class
    ) -> None:
        super().__init__()
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = layout.num_local_heads
        self.num_kv_heads = layout.num_local_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        # Row-parallel: each rank's partial product, summed by an all-reduce (a
        # bias is loaded on rank 0 only).
        self.o_proj = linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.tp = tp
        offset = cfg.gemma.norm_weight_offset
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, weight_offset=offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, weight_offset=offset)
        self.qk_norm = cfg.qk_norm
        self.eps = cfg.rms_norm_eps
        # Fused: q/k norm, RoPE and the KV-cache store in one in-place Triton
        # kernel (Llama-form norms only: Gemma's run as torch ops).
        self.fused = fused and offset == 0.0
        # What the backend needs of this layer (vLLM's names), passed only when set
        # so that backends without them keep their signature.
        self.layer_kwargs: dict[str, float | int | torch.Tensor] = {}
        window = cfg.layer_window(layer)
        if window is not None:
            self.layer_kwargs["sliding_window"] = window
        if cfg.attn_logit_softcapping is not None:
            self.layer_kwargs["logits_soft_cap"] = cfg.attn_logit_softcapping
        # Shared, not owned: registering them as submodules would duplicate them.
        self._rotary = (rotary,)
        self.backend = backend
        # Set by the model runner once the KV cache is allocated. An FP8 cache
        # adds ``kv_scales`` ([k_scale, v_scale], float32) to layer_kwargs and
        # turns ``store_in_rope`` off: the fused kernel stores unscaled values,
        # the backend's store quantizes.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.store_in_rope = self.fused
        # calculate_kv_scales: set once the engine is built, cleared by the
        # first step that attends (its K and V give the layer's scales).
        self.scales_pending = False

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.project(positions, x, meta.slot_mapping)
        return self.output(self.attend(q, k, v, meta))

    # The three parts of forward, apart for the piecewise CUDA graphs
    # (engine/piecewise_graphs.py): ``project`` and ``output`` are captured,
    # ``attend`` runs eagerly between them.
    def project(
        self, positions: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D], RoPE applied. Fused, k and v are also
        in the KV cache already (slot -1: a padding row, not stored)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        rotary = self._rotary[0]
        if self.fused:
            from engine.layers.fused_kernels import rope_qk_

            # q and k in one launch, and the new K/V written into the cache by it.
            rope_qk_(
                q,
                k,
                positions,
                rotary.cos_cache,
                rotary.sin_cache,
                self.q_norm.weight if self.qk_norm else None,
                self.k_norm.weight if self.qk_norm else None,
                self.eps,
                kv_store=(v, self.k_cache, self.v_cache, slot_mapping)
                if self.store_in_rope
                else None,
            )
        else:
            if self.qk_norm:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q, k = rotary(positions, q, k)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, Hq, D]: the attention of the step's tokens (fused: K/V stored by
        ``project``), written into ``out`` when given."""
        backend = self.backend
        kw = self.layer_kwargs
        if self.scales_pending:
            self._compute_kv_scales(k, v)
        stored = self.store_in_rope
        if out is not None and backend.accepts_out:
            return backend.forward(
                q, k, v, self.k_cache, self.v_cache, meta, kv_stored=stored, out=out, **kw
            )
        result = backend.forward(q, k, v, self.k_cache, self.v_cache, meta, kv_stored=stored, **kw)
        return result if out is None else out.copy_(result)

    def _compute_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's scales from the first step's K and V (vLLM's
        calculate_kv_scales), in place: graphs read them through their pointer."""
        from engine.layers.attention.kv_quant import compute_scales

        self.layer_kwargs["kv_scales"].copy_(compute_scales(k, v))
        self.scales_pending = False

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


def make_mlp(
    cfg: ModelArchConfig,
    layer: int,
    tp: TPGroup,
    layout: TPLayout,
    fused: bool = False,
    triton_moe: bool = False,
    linear: type[nn.Module] = SkinnyLinear,
) -> nn.Module:
    """Layer ``layer``'s MLP: a mixture of experts where the family makes it
    sparse, else the dense gated MLP."""
    moe = cfg.moe
    if moe is not None and moe.sparse_layers[layer]:
        return FusedMoE(
            cfg.hidden_size,
            moe.num_experts,
            moe.top_k,
            layout.local_expert_intermediate,
            tp,
            moe.renormalize,
            shared_intermediate=layout.local_shared_intermediate,
            fused_ops=fused,
            use_triton=triton_moe,
        )
    return GatedMLP(
        cfg.hidden_size,
        layout.local_intermediate,
        tp,
        bias=cfg.mlp_bias,
        hidden_act=cfg.hidden_act,
        fused=fused,
        linear=linear,
    )


class VocabParallelEmbedding(nn.Module):
    """The embedding rows of this rank's vocabulary shard; an all-reduce puts
    each token's row (found on exactly one rank, zeros elsewhere) on every rank."""

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup, layout: TPLayout) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_shard_size, cfg.hidden_size))
        self.first = layout.vocab_range.start
        self.tp = tp
        # Gemma multiplies the rows by sqrt(hidden_size), rounded to the weights'
        # dtype first as Hugging Face does.
        self.scale = cfg.gemma.embed_scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            x = F.embedding(input_ids, self.weight)
        else:
            local = input_ids - self.first
            outside = (local < 0) | (local >= self.weight.shape[0])
            x = F.embedding(local.masked_fill(outside, 0), self.weight)
            x.masked_fill_(outside.unsqueeze(-1), 0.0)
            x = self.tp.all_reduce(x)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=self.weight.dtype)
        return x


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        tp: TPGroup,
        layout: TPLayout,
        fused: bool = False,
        layer: int = 0,
        triton_moe: bool = False,
        linear: type[nn.Module] = SkinnyLinear,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rotary, backend, tp, layout, fused, layer, linear)
        self.mlp = make_mlp(cfg, layer, tp, layout, fused, triton_moe, linear)

        def norm() -> RMSNorm:
            h, eps = cfg.hidden_size, cfg.rms_norm_eps
            return RMSNorm(h, eps, fused, weight_offset=cfg.gemma.norm_weight_offset)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        # Gemma: post_attention_layernorm normalises the attention's output before
        # the residual add, and two more norms wrap the MLP the same way.
        self.sandwich = cfg.gemma.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            # The residual stream is fp32 whatever the activation dtype (no bf16
            # rounding of the running sum at every layer).
            residual = x.to(torch.float32)
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        return self.after_attention(x, residual)

    def after_attention(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention's output to the MLP's (the piecewise CUDA graphs
        capture this part: engine/piecewise_graphs.py)."""
        if self.sandwich:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        backend: AttentionBackend,
        max_positions: int,
        fused_ops: bool = False,
        tp: TPGroup | None = None,
        triton_moe: bool = False,  # experts by the fused Triton kernel (else the torch loop)
        quantization: Quantization | None = None,  # FP8 projections (experts stay unquantized)
        offload: WeightOffloader | None = None,  # cpu_offload_gb: layers streamed from the host
    ) -> None:
        super().__init__()
        self.config = cfg
        self.offload = offload
        self.tp = tp if tp is not None else TPGroup.single(torch.device("cpu"))
        self.layout = TPLayout.for_model(cfg, self.tp.rank, self.tp.size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        # Gemma3's sliding layers rotate with their own base.
        self.local_rotary = (
            RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope)
            if cfg.local_rope is not None
            else None
        )
        self.embed_tokens = VocabParallelEmbedding(cfg, self.tp, self.layout)
        # Each layer offered to the offloader as soon as it is built, so the
        # device never holds the offloaded layers all at once.
        place = offload.adopt if offload is not None else lambda _, layer: layer
        self.layers = nn.ModuleList(
            place(
                i,
                DecoderLayer(
                    cfg,
                    self._rotary_of(i),
                    backend,
                    self.tp,
                    self.layout,
                    fused_ops,
                    layer=i,
                    triton_moe=triton_moe,
                    linear=linear_class(quantization),
                ),
            )
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, fused_ops, cfg.gemma.norm_weight_offset
        )
        # Vocabulary-parallel: each rank's logits for its shard, all-gathered.
        # Built on the meta device, its weight set below: no random init for
        # the loader to overwrite (see SkinnyLinear.reset_parameters).
        self.lm_head = nn.Linear(cfg.hidden_size, self.layout.vocab_shard_size, bias=False,
                                 device="meta")  # fmt: skip
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight = nn.Parameter(
                torch.empty(self.layout.vocab_shard_size, cfg.hidden_size)
            )
        self._fp32_logits_gemm = True

    def _rotary_of(self, layer: int) -> RotaryEmbedding:
        if self.local_rotary is not None and self.config.layer_window(layer) is not None:
            return self.local_rotary
        return self.rotary

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def load_layer(self, i: int) -> None:
        """Before layer i runs: its weights onto the device if they are offloaded."""
        if self.offload is not None:
            self.offload.load(i)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden_size].

        ``after_layer(i)`` (engine/kv_writes.py) runs once layer i is issued."""
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            self.load_layer(i)
            x, residual = layer(positions, x, residual, meta)
            if after_layer is not None:
                after_layer(i)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits. Rounded to bf16 (8 mantissa bits on values of 10-30), the top
        two tokens tie exactly at a few percent of positions; the GEMM accumulates in
        fp32 anyway, so ask for fp32 output where torch can."""
        logits = None
        if hidden.dtype != torch.float32 and hidden.is_cuda and self._fp32_logits_gemm:
            try:
                logits = torch.mm(hidden, self.lm_head.weight.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError):  # a torch without mixed-precision GEMM output
                self._fp32_logits_gemm = False
        if logits is None:
            logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        if self.tp.size == 1:
            return logits
        # Every rank's shard side by side, the last shard's padding cut off.
        return self.tp.all_gather_last_dim(logits)[:, : self.config.vocab_size]
