"""Runs the model for one scheduled batch: builds inputs, forwards, samples.

It owns everything on the device: weights, the paged KV cache (one tensor of
shape ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``; each
layer sees views ``kv[0, i]`` and ``kv[1, i]``), the sampler, and per-request
random generators. What it returns is plain Python data, so the scheduler and
output processing stay free of torch.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.async_step import ForwardedStep, InFlightStep, patch_indices
from engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, LoadFormat
from engine.cuda_graphs import DecodeGraphs
from engine.device import GiB, available_host_memory, default_dtype, resolve_device, resolve_dtype
from engine.host_tier import TierPlan
from engine.kernel_warmup import warm_up_kernels
from engine.kv_blocks import Range, gather_blocks, scatter_blocks
from engine.kv_writes import KVWriteObserver
from engine.layers.attention import AttentionBackend, select_backend
from engine.layers.attention.kv_quant import FP8_KV_DTYPE, storage_view
from engine.layers.sampler import GrammarBitmask, Sampler, SamplingRow
from engine.layers.skinny_gemm_plan import plan_model
from engine.lora.manager import LoRAManager
from engine.lora.slots import LoRASlots
from engine.model_io import ModelInputs, StepOutput
from engine.models.decoder import DecoderForCausalLM
from engine.models.kv_scales import read_kv_scales
from engine.models.loader import init_dummy_weights, load_weights
from engine.parallel.group import TPGroup
from engine.parallel.handoff import Logits, StepPlan
from engine.piecewise_graphs import PiecewiseGraphs, piecewise_graphs_for
from engine.prompt_logprobs import (
    prompt_logprob_entries,
    prompt_logprob_parts,
    wants_prompt_logprobs,
)
from engine.quantization.fp8 import check_fp8_device
from engine.sampling_params import SamplingParams
from engine.sampling_rows import SamplingRows
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeMethod
from engine.spec_decode.draft_model import DraftModel
from engine.spec_decode.verify_rows import (
    VerifyLayout,
    expand_rows,
    settle_generators,
    verify_layout,
)
from engine.step_inputs import HostStaging, host_inputs, to_model_inputs
from engine.tier_copies import TierCopier
from engine.tp_layout import TPLayout
from engine.weight_offload import WeightOffloader

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's model. With tensor parallelism (``tp`` of several ranks) rank
    0's runner is the engine's: it plans each step and sends the plan to the
    others (engine/parallel/handoff.py), whose runners ``follow`` it."""

    def __init__(
        self, config: EngineConfig, eos_token_ids: frozenset[int], tp: TPGroup | None = None
    ) -> None:
        self.config = config
        self.eos_token_ids = eos_token_ids
        cfg = config.model_config
        self.device = resolve_device(config.device)
        self.tp = tp if tp is not None else TPGroup.single(self.device)
        self.handoff = self.tp.handoff
        if self.tp.size > 1 and self.handoff is None:
            raise ValueError("a tensor-parallel rank needs its group's hand-off channel")
        self.layout = TPLayout.for_model(cfg, self.tp.rank, self.tp.size)
        self.dtype = resolve_dtype(config.dtype, cfg.torch_dtype, self.device)
        self.block_size = config.kvcache_block_size
        # What the KV cache stores: the model's dtype, or FP8 (kv_cache_dtype).
        self.kv_dtype = FP8_KV_DTYPE if config.kv_cache_dtype.is_fp8 else self.dtype
        self.attention_backend = self._make_backend()
        self.model = self._load_model()
        # LoRA: the projections wrapped (before the skinny-GEMM plans and the
        # graphs), the device slots' bookkeeping for the scheduler.
        self.lora: LoRAManager | None = None
        self.lora_slots: LoRASlots | None = None
        if config.enable_lora:
            use_triton = self.device.type == "cuda" and _triton_available()
            self.lora = LoRAManager(
                config, self.model, self.layout, self.device, self.dtype, use_triton
            )
            self.lora_slots = LoRASlots(config.max_loras)
        # Draft-model speculation: its weights count before the KV pool is sized.
        self.draft = self._load_draft()
        # Decode-sized matmuls: the skinny kernel where it beats cuBLAS (before
        # the graphs are captured, so they capture the chosen kernels).
        self.gemv_plans = plan_model(self.model, config.gemv_backend, self.device, self.dtype)
        self.sampler = Sampler(cfg.vocab_size, self.device, config.seed)
        self.sampling_rows = SamplingRows(self.device, cfg.vocab_size, eos_token_ids)
        self.staging = HostStaging(self.device)
        self._make_kv_pool()
        # Told when each layer of a step wrote its KV (a prefill node streaming it).
        self.kv_observer: KVWriteObserver | None = None
        if self.lora is not None:  # the graphs capture the LoRA kernels too
            self.lora.ctx.batch = self.lora.graph_batch
        self.graphs = self._decode_graphs()
        # Steps with prefill rows: graphs of everything between the attention calls.
        self.piecewise: PiecewiseGraphs | None = piecewise_graphs_for(
            config, self.model, self.attention_backend, self.device, self.dtype, self.tp.size
        )
        if self.lora is not None:
            self.lora.end_step()
        if self.device.type == "cuda":  # compiles now, not under load (kernel_warmup.py)
            warm_up_kernels(self)
        if config.calculate_kv_scales and self.kv_dtype != self.dtype:
            # From the first real step on: not the profile or warm-up passes.
            for attn in self.model.attention_layers:
                attn.scales_pending = True

    def _make_backend(self) -> AttentionBackend:
        """The attention backend for this rank's heads (all of them without
        tensor parallelism), one that reads the cache's dtype."""
        config, cfg = self.config, self.config.model_config
        backend_cls = select_backend(
            config.attention_backend,
            self.device,
            self.dtype,
            cfg,
            fp8_kv=self.kv_dtype != self.dtype,
        )
        return backend_cls(
            self.layout.num_local_heads,
            self.layout.num_local_kv_heads,
            cfg.head_dim,
            cfg.softmax_scale,
            self.block_size,
        )

    def _make_kv_pool(self) -> None:
        """The KV scales, the pool's size and the pool (and the draft's)."""
        config = self.config
        # Each layer's [k_scale, v_scale], read even for a cache in the model's
        # dtype: a prefill node quantizes on the way to an FP8 peer with them.
        model_dir = None if config.load_format is LoadFormat.DUMMY else config.model
        num_layers = config.model_config.num_hidden_layers
        self.kv_scales = read_kv_scales(model_dir, num_layers).to(self.device)
        # Every rank holds the same blocks (its heads of them): the smallest pool wins.
        self.num_kvcache_blocks = self.tp.min_int(self._decide_num_blocks())
        self.kv_cache = self._allocate_kv_cache(self.num_kvcache_blocks)
        if self.draft is not None:  # the same block ids index its own pool
            self.draft.allocate_kv_cache(self.num_kvcache_blocks)
        self.tier_copier = self._make_host_tier()

    def _make_host_tier(self) -> TierCopier | None:
        """This rank's host tier (``swap_space`` GiB, per rank like vLLM's per
        GPU): its heads of every slot. Every rank holds the same slots (the
        smallest count wins); rank 0's engine keeps their bookkeeping."""
        space = self.config.swap_space
        if not space:
            return None
        num_slots = self.tp.min_int(int(space * GiB) // self.kv_block_bytes)
        if num_slots < 1:
            raise ValueError(
                f"swap_space ({space} GiB) holds no KV block ({self.kv_block_bytes} bytes)"
            )
        # As bytes where FP8 (no FP8 index_copy_ on a CPU): the cache dtype unchanged.
        return TierCopier(storage_view(self.kv_cache), num_slots)

    def _load_model(self) -> DecoderForCausalLM:
        """This rank's part of the model, its weights loaded (or dummy ones)."""
        config = self.config
        torch.manual_seed(config.seed)
        on_gpu = self.device.type == "cuda" and _triton_available()  # fused ops, fused MoE
        if config.quantization is not None:
            check_fp8_device(self.device)
        # cpu_offload_gb: the first layers that fit it live in host memory
        # (engine/weight_offload.py); the KV pool is sized after, so it gets the room.
        self.offload = (
            WeightOffloader(int(config.cpu_offload_gb * GiB), self.device)
            if config.cpu_offload_gb
            else None
        )
        with torch.device(self.device), default_dtype(self.dtype):
            model = DecoderForCausalLM(
                config.model_config, self.attention_backend, config.max_model_len,
                config.fused_ops and on_gpu, self.tp, triton_moe=on_gpu,
                quantization=config.quantization, offload=self.offload,
            )  # fmt: skip
        if config.load_format is LoadFormat.DUMMY:
            init_dummy_weights(model, config.seed)
        else:
            load_weights(model, config.model)
        if self.offload is not None:
            self.offload.attach()
        return model.eval()

    def _load_draft(self) -> DraftModel | None:
        spec = self.config.speculative_config
        if spec is None or spec.method is not SpeculativeMethod.DRAFT_MODEL:
            return None
        config = self.config
        return DraftModel(
            spec.model,
            self.device,
            self.dtype,
            self.block_size,
            config.max_model_len,
            config.attention_backend,
            config.seed if config.load_format is LoadFormat.DUMMY else None,
            config.seed,
            config.max_num_batched_tokens,
            self.tp,
        )

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode steps, where the device and backend allow them."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if not self.attention_backend.supports_cuda_graphs:
            logger.info(
                "CUDA graphs are off: the %s attention backend reads host values",
                self.attention_backend.name.value,
            )
            return None
        return DecodeGraphs(
            self.config, self.model, self.attention_backend, self.device, self.dtype
        )

    # ------------------------------------------------------------- KV cache
    @property
    def kv_block_bytes(self) -> int:
        cfg = self.config.model_config
        elem = torch.empty(0, dtype=self.kv_dtype).element_size()
        return (
            2
            * cfg.num_hidden_layers
            * self.block_size
            * self.layout.num_local_kv_heads
            * cfg.head_dim
            * elem
        )

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks > 0:
            num_blocks = cfg.num_kvcache_blocks
        else:
            if cfg.kv_cache_memory_bytes is not None:
                budget = cfg.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                budget = self._profile_cuda_budget()
            else:
                budget = min(DEFAULT_CPU_KV_CACHE_BYTES, available_host_memory() // 2)
            per_block = self.kv_block_bytes + (self.draft.block_bytes if self.draft else 0)
            num_blocks = budget // per_block
            if num_blocks < 1:
                raise ValueError(
                    f"no memory is left for the KV cache (budget {budget / GiB:.2f} GiB); raise "
                    "gpu_memory_utilization or kv_cache_memory_bytes, or set num_kvcache_blocks"
                )
        capacity = num_blocks * self.block_size
        if capacity < cfg.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
                f"{self.block_size}), fewer than max_model_len ({cfg.max_model_len}); lower "
                "max_model_len or raise num_kvcache_blocks / gpu_memory_utilization"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %.1f full-length sequences)",
            num_blocks,
            self.block_size,
            capacity,
            num_blocks * self.kv_block_bytes / GiB,
            capacity / cfg.max_model_len,
        )
        return num_blocks

    def gather_kv(
        self, block_ids, layers: Range | None = None, heads: Range | None = None
    ) -> torch.Tensor:
        """These blocks' K and V (of every layer and head, or of these ranges), contiguous."""
        return gather_blocks(self.kv_cache, block_ids, layers, heads)

    def scatter_kv(
        self, block_ids, data: torch.Tensor, layers: Range | None = None, heads: Range | None = None
    ) -> None:
        """Write ``gather_kv``'s layout (or its raw bytes) into these blocks."""
        scatter_blocks(self.kv_cache, block_ids, data, layers, heads)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        cfg = self.config.model_config
        # Zeroed on a GPU: kernels that load whole pages (FlashAttention-4's TMA
        # path) read the unused rows of a sequence's last page, and a NaN there
        # would poison the output through 0 * NaN. Left lazy on a CPU, where
        # touching every page would commit the whole pool up front.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        kv = alloc(
            2,
            cfg.num_hidden_layers,
            num_blocks,
            self.block_size,
            self.layout.num_local_kv_heads,
            cfg.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        quantized = self.kv_dtype != self.dtype
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache = kv[0, i]
            attn.v_cache = kv[1, i]
            if quantized:
                attn.layer_kwargs["kv_scales"] = self.kv_scales[i]
                attn.store_in_rope = False
        return kv

    def _profile_cuda_budget(self) -> int:
        """KV budget = utilisation x total - (weights + peak activations + non-torch memory)."""
        cfg = self.config
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        # The largest batch the scheduler can form: the token budget, split into
        # as few sequences as max_model_len allows.
        num_tokens = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        num_seqs = -(-num_tokens // cfg.max_model_len)
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        temp_blocks = sum(-(-n // self.block_size) for n in lens)
        temp_kv = self._allocate_kv_cache(temp_blocks)
        temp_bytes = temp_kv.numel() * temp_kv.element_size()
        self.profile_run(lens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - temp_bytes
        # The layers' views keep the temporary cache alive: drop them too.
        for attn in self.model.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        del temp_kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = total - free - torch.cuda.memory_reserved()
        budget = int(total * cfg.gpu_memory_utilization - peak - non_torch)
        logger.info(
            "memory: weights %.2f GiB, peak activations %.2f GiB, non-torch %.2f GiB, "
            "GPU total %.2f GiB x %.2f utilisation -> KV budget %.2f GiB",
            weights / GiB,
            (peak - weights) / GiB,
            non_torch / GiB,
            total / GiB,
            cfg.gpu_memory_utilization,
            budget / GiB,
        )
        return budget

    @torch.inference_mode()
    def profile_run(self, lens: list[int]) -> None:
        """A forward + logits pass over prompts of these lengths (uses blocks from 0 on)."""
        tables: list[list[int]] = []
        next_block = 0
        for n in lens:
            num_blocks = -(-n // self.block_size)
            tables.append(list(range(next_block, next_block + num_blocks)))
            next_block += num_blocks
        inputs = self.build_inputs([[0] * n for n in lens], [0] * len(lens), lens, tables)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        # The sampler's peak: a decode step samples up to max_num_seqs rows with
        # top-k/top-p (a full-vocabulary sort) and logprobs.
        # With speculation a sequence samples each of its 1 + k positions.
        spec = self.config.speculative_config
        per_seq = 1 + spec.num_speculative_tokens if spec is not None else 1
        num_rows = min(self.config.max_num_seqs * per_seq, self.config.max_num_batched_tokens)
        rows_hidden = hidden[torch.arange(num_rows, device=self.device) % hidden.shape[0]]
        logits = self.model.compute_logits(rows_hidden)
        params = SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, logprobs=self.config.max_logprobs
        )
        self.sampler(logits, [SamplingRow(params, [0], 1, None, [])] * num_rows)

    # --------------------------------------------------------------- inputs
    def build_inputs(
        self,
        token_ids: list[list[int]],
        starts: list[int],
        num_new: list[int],
        block_tables: list[list[int]],
    ) -> ModelInputs:
        """Sequence i contributes tokens ``token_ids[i][starts[i]:starts[i] + num_new[i]]``."""
        host = host_inputs(token_ids, starts, num_new, block_tables, self.block_size)
        return to_model_inputs(host, self.staging)[0]

    # -------------------------------------------------------------- execute
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step and wait for its results."""
        return self.launch(batch).wait()

    @torch.inference_mode()
    def launch(
        self,
        batch: ScheduledBatch,
        prev: InFlightStep | None = None,
        non_blocking: bool = False,
        bitmask: GrammarBitmask | None = None,
    ) -> InFlightStep:
        """Enqueue one step on the device; ``prev``'s unread samples feed its inputs.

        ``non_blocking``: copy the samples back without waiting (async scheduling);
        the caller reads them with ``InFlightStep.read``. ``bitmask``: the
        structured-output rows' allowed tokens.
        """
        return self.sample_step(self.forward_step(batch, prev, non_blocking), bitmask)

    @torch.inference_mode()
    def forward_step(
        self, batch: ScheduledBatch, prev: InFlightStep | None = None, non_blocking: bool = False
    ) -> ForwardedStep:
        """The first half of ``launch``: enqueue the forward and the sampled rows'
        logits, not the sampling. Structured outputs under async scheduling
        sample in a second call (``sample_step``), once the host has read
        ``prev`` and advanced the grammars by its tokens: the device runs this
        forward meanwhile."""
        seqs = batch.seqs
        num_new = batch.num_new_tokens
        starts = [s.num_computed_tokens for s in seqs]
        host = host_inputs(
            # A speculating sequence's step runs its proposed tokens too.
            [s.token_ids + s.spec_token_ids if s.spec_token_ids else s.token_ids for s in seqs],
            starts,
            num_new,
            [s.block_table for s in seqs],
            self.block_size,
        )
        sampling = batch.sampling_rows()
        plan = StepPlan(host)
        if self.lora is not None:
            self.lora.plan_step(plan, [s.lora_request for s in seqs], num_new, self.lora_slots)
        verify = _plan_logits(plan, sampling, seqs) if sampling else None
        prompt_parts = prompt_logprob_parts(seqs, num_new, host.query_start_loc)
        plan.prompt_slices = [(lo, hi) for _, _, lo, hi in prompt_parts]
        # The previous step's samples that this step's inputs still lack.
        patch = patch_indices(host, seqs, prev)
        plan.patched = patch is not None
        # At the first device work, after the input build (InFlightStep.idle_seconds).
        began = InFlightStep.mark_begin(self.device, non_blocking)
        # A step whose KV someone streams layer by layer never replays a whole-
        # model graph (it would hide the layers); piecewise graphs call the hook
        # between their pieces, so a prefill node's steps of up to 512 tokens
        # keep them (docs/lab/2026-11-26-layer-wise-kv-streaming.md).
        after_layer = self.kv_observer.begin_step(batch) if self.kv_observer else None
        hidden, logits_of = self._forward(plan, patch, prev, after_layer)
        logits = logits_of(hidden) if sampling else None
        prompt_logprobs = None
        for row, start, lo, hi in prompt_parts:
            if prompt_logprobs is None:
                prompt_logprobs = [[] if wants_prompt_logprobs(s) else None for s in seqs]
            part = self.model.compute_logits(hidden[lo:hi])
            prompt_logprobs[row].extend(prompt_logprob_entries(seqs[row], start, part))
        return ForwardedStep(
            batch,
            sampling,
            logits,
            prompt_logprobs,
            non_blocking,
            began,
            prev,
            after_layer is not None,
            verify,
        )

    @torch.inference_mode()
    def sample_step(
        self, fwd: ForwardedStep, bitmask: GrammarBitmask | None = None
    ) -> InFlightStep:
        """The second half of ``launch``: sample the forwarded step's rows."""
        samples = None
        if fwd.sampling:
            seqs = fwd.batch.seqs
            row_of = self.sampling_rows.get
            rows = [row_of(seqs[i]) for i in fwd.sampling]
            drafts = None
            if fwd.verify is not None:
                verifying = [seqs[i] for i in fwd.sampling]
                if self.draft is not None:  # its sampled proposals, with their probabilities
                    gens = [None if r.params.greedy else r.generator for r in rows]
                    drafts = self.draft.take_probs(verifying, fwd.verify.first, gens)
                # (A bitmask is per sample row already: engine/structured/manager.py.)
                rows = expand_rows(fwd.verify, rows, verifying)
            samples = self.sampler.sample(fwd.logits, rows, bitmask, drafts)
            if fwd.observed:  # the observer may send first tokens (kv_writes.py)
                self.kv_observer.step_sampled(samples, fwd.sampling)
        fwd.logits = None
        step = InFlightStep.start(
            fwd.batch,
            fwd.sampling,
            samples,
            fwd.prompt_logprobs,
            fwd.non_blocking,
            fwd.began,
            fwd.prev,
        )
        step.verify = fwd.verify
        return step

    def settle_generators(self, verify: VerifyLayout) -> None:
        """After a verify step's tokens were accepted: seeded generators as if the
        step had drawn once per emitted token (engine/spec_decode/verify_rows.py)."""
        settle_generators(verify, self.config.model_config.vocab_size, self.device)

    def _forward(
        self,
        plan: StepPlan,
        patch: tuple[np.ndarray, np.ndarray] | None = None,
        prev: InFlightStep | None = None,
        after_layer=None,
    ):
        """The step's hidden states on this rank, and a function giving the
        sampled rows' logits. Rank 0 first sends the plan to the other ranks."""
        extra = list(patch) if patch is not None else []
        if plan.lora_slots is not None:  # in the inputs' one copy
            extra.append(plan.lora_slots)
        if plan.logit_rows is not None:
            extra.append(plan.logit_rows)
        inputs, extra_dev = to_model_inputs(plan.host, self.staging, extra)
        # The graphs hold the LoRA products only where the Triton kernels run
        # (they read each token's slot from a buffer: engine/lora/manager.py).
        # A verify step (several query positions per sequence) never replays a
        # decode graph, which is captured for one position per row; piecewise
        # graphs are row-wise and read one slot per token, 1 + k per verify row.
        graphs_ok = plan.lora_slots is None or self.lora.in_graphs
        if self.tp.is_driver:
            plan.tier_landed = self.tier_copier.num_retired if self.tier_copier else 0
            plan.use_graph = (
                after_layer is None
                and graphs_ok
                and self.graphs is not None
                and self.graphs.can_run(inputs)
            )
            if self.handoff is not None:
                self.handoff.send(plan)
        piecewise = (
            not plan.use_graph
            and graphs_ok
            and self.piecewise is not None
            and self.tp.size == 1
            and self.piecewise.can_run(inputs)
        )
        if self.lora is not None:
            slots_dev = extra_dev[len(patch or ())] if plan.lora_slots is not None else None
            self.lora.begin_step(plan, slots_dev, graph=plan.use_graph or piecewise)
        if patch is not None:
            dest, src = extra_dev[0], extra_dev[1]
            inputs.input_ids[dest] = prev.sampled_device[src]
        if plan.patched:
            # Those samples exist on rank 0's device only.
            self.tp.broadcast(inputs.input_ids)
        if plan.use_graph:
            hidden = self.graphs.run(inputs)
        elif piecewise:
            hidden = self.piecewise.run(inputs, after_layer)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, after_layer)
        if self.lora is not None:
            self.lora.end_step()

        def logits_of(h: torch.Tensor) -> torch.Tensor:
            return self.model.compute_logits(h[extra_dev[-1]] if plan.logit_rows is not None else h)

        return hidden, logits_of

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """Ranks 1..t-1: rank 0's step, for its collectives (the logits this rank
        computes are its share of the all-gather; rank 0 samples). An observer
        this rank's worker extension installed learns of the step from rank 0's
        call before it, so it is asked with no batch."""
        if plan.draft:  # a proposal's forward, between the target's steps
            self.draft.follow(plan)
            return
        if self.tier_copier is not None:  # rank 0 saw these loads land: so must this rank
            self.tier_copier.retire(until=plan.tier_landed)
        after_layer = None
        if self.kv_observer is not None and not plan.use_graph:
            after_layer = self.kv_observer.begin_step(None)
        hidden, logits_of = self._forward(plan, after_layer=after_layer)
        if plan.logits is not Logits.NONE:
            logits_of(hidden)
        for lo, hi in plan.prompt_slices:
            self.model.compute_logits(hidden[lo:hi])

    def follow_tier(self, plan: TierPlan) -> None:
        """Ranks 1..t-1: a batch of host-tier copies rank 0 issues, on this
        rank's heads of the same blocks and slots, after the batches rank 0
        had retired are retired here too (their slots may be read now)."""
        self.tier_copier.retire(until=plan.landed)
        self.tier_copier.issue(plan.copies)
        if plan.wait:
            self.tier_copier.retire(wait=True)

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence state (its random generator, its sampling row) once it
        finished."""
        self.sampling_rows.release(seq)


def _plan_logits(plan: StepPlan, sampling: list[int], seqs: list[Sequence]) -> VerifyLayout | None:
    """Which hidden rows give logits: each sampled row's last token, or every
    position of a speculating row (its layout returned; None without one)."""
    host = plan.host
    verify = verify_layout(host.query_start_loc, sampling, seqs)
    num_rows = verify[0].num_rows if verify is not None else len(sampling)
    # A decode step where every row samples reads every hidden row: no gather.
    if num_rows == host.num_tokens:
        plan.logits = Logits.ALL
    else:
        plan.logits = Logits.ROWS
        plan.logit_rows = (
            verify[1] if verify is not None else host.query_start_loc[1:][sampling] - 1
        )
    return verify[0] if verify is not None else None


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
