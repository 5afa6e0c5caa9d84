"""Engine configuration with vLLM's field names, validated with errors that name the field.

Modes are Enums inside the engine; the public constructor also takes their
string values (``attention_backend="torch"``), as vLLM's does.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.kv_cache_dtype import KVCacheDType
from engine.layers.specs import AttentionBackendName, GemvBackend
from engine.lora.config import LoRADType, check_lora_options
from engine.models.config import ModelArchConfig
from engine.quantization.scheme import Quantization, parse_quantization, resolve_quantization
from engine.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from engine.structured.config import StructuredOutputsConfig
from engine.tp_layout import TPLayout

logger = logging.getLogger(__name__)

_EXTENSION_NAME = re.compile(r"[A-Za-z_][\w.]*[:.][A-Za-z_]\w*")

ALLOWED_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256
# Without a GPU the KV pool is sized from this many bytes unless told otherwise
# (vLLM's CPU backend has the same kind of knob, VLLM_CPU_KVCACHE_SPACE).
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"  # free the blocks; recompute from the prefix cache on resume
    SWAP = "swap"  # copy the blocks to the host tier and back (needs swap_space)


class LoadFormat(enum.Enum):
    AUTO = "auto"  # safetensors from the model directory
    DUMMY = "dummy"  # random weights from config.json alone (benchmarks)


class DeviceKind(enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


# vLLM's dtype spellings.
_DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def _check_draft_split(draft: ModelArchConfig, size: int) -> None:
    """The draft runs sharded over the target's ranks (vLLM's default draft
    tensor-parallel size is the target's): it must split over as many."""
    try:
        TPLayout.for_model(draft, 0, size)
    except ValueError as e:
        raise ValueError(
            f"speculative_config.model cannot run at tensor_parallel_size {size} ({e}); the "
            "draft model runs with the target's tensor_parallel_size, so it must split over "
            "as many ranks (or use method 'ngram')"
        ) from e


def _parse_enum(name: str, value: Any, enum_cls: type[enum.Enum]) -> Any:
    if isinstance(value, enum_cls):
        return value
    for member in enum_cls:
        if value == member.value:
            return member
    allowed = ", ".join(repr(m.value) for m in enum_cls)
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def _require_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}; got {value}")


def _require_gib(name: str, value: Any) -> None:
    """A finite number of GiB >= 0."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a number of GiB >= 0; got {value!r}")


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_logprobs: int = 20
    gpu_memory_utilization: float = 0.9
    kvcache_block_size: int = 16
    num_kvcache_blocks: int = -1
    kv_cache_memory_bytes: int | None = None
    # vLLM's: what the KV cache stores ("auto": the model's dtype; "fp8" or
    # "fp8_e4m3": float8 e4m3, half the bytes, with a scale per layer for K and
    # for V: the checkpoint's k_scale / v_scale, else 1.0, or with
    # calculate_kv_scales, computed from the first prompt's K and V).
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO
    calculate_kv_scales: bool = False
    enforce_eager: bool = False
    # pdserve-specific: fused Triton kernels for RMSNorm, SiLU-and-mul and RoPE on
    # CUDA (False: the plain torch ops, e.g. to measure what they buy).
    fused_ops: bool = True
    # pdserve-specific: steps with prefill rows replay CUDA graphs of everything
    # between the attention calls, attention run eagerly between them
    # (engine/piecewise_graphs.py; CUDA, one rank, backends that write into a
    # given buffer: triton). On: an eager step of a large model is bound by the
    # host's Python (docs/lab/2026-11-25-shared-prefix-steps-slower.md).
    piecewise_cuda_graphs: bool = True
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    # vLLM's name: GiB of host memory holding KV blocks behind the device pool
    # (engine/host_tier.py): evicted prefix-cache blocks spill there and hits
    # are copied back; preemption_mode="swap" parks preempted sequences there.
    # Per tensor-parallel rank (vLLM's "per GPU"): each holds its heads of every
    # slot. 0: no host tier.
    swap_space: float = 0
    # vLLM's name: GiB of the model's weights kept in host memory (per
    # tensor-parallel rank): whole decoder layers from the first, each copied
    # to the device just before it runs (engine/weight_offload.py), so a model
    # somewhat larger than the device fits and the KV pool gets the room. CUDA
    # graphs stay on: they capture the copies from pinned memory. 0: none.
    cpu_offload_gb: float = 0
    tensor_parallel_size: int = 1
    # vLLM's name: "fp8" quantizes the projections' weights to FP8 at load
    # (W8A8: activations per token at run time; engine/quantization/). None:
    # the checkpoint's own quantization_config decides (FP8 checkpoints set it).
    quantization: Quantization | str | None = None
    load_format: LoadFormat = LoadFormat.AUTO
    skip_tokenizer_init: bool = False
    device: DeviceKind = DeviceKind.AUTO
    attention_backend: AttentionBackendName = AttentionBackendName.AUTO
    # pdserve-specific: decode-sized matmuls (1..16 tokens) by our skinny Triton
    # kernel where it beats cuBLAS ("auto": a tuned table for this GPU, else a
    # measurement at load), always ("triton"), or never ("torch"). CUDA bf16/fp16
    # only; engine/layers/skinny_gemm.py.
    gemv_backend: GemvBackend = GemvBackend.AUTO
    # Overlap the host's scheduling and output processing with the device's step
    # (vLLM's name). None: on for CUDA, off elsewhere; True also works on a CPU
    # (the same code path, without the overlap), which is how CI covers it.
    async_scheduling: bool | None = None
    # With async scheduling, a serving engine builds step N+1 as late as it can
    # while still launching it before step N ends, so requests that arrived
    # during N join N+1 instead of N+2 (engine/step_clock.py). LLM.generate
    # never waits; off: N+1 is built right after N is launched.
    late_launch: bool = True
    # vLLM's name: "module:Class" (or "module.Class") that every tensor-parallel
    # rank but rank 0 instantiates with its ModelRunner; rank 0 reaches it with
    # LLMEngine.call_workers (a node's KV transfer runs on every rank this way).
    worker_extension_cls: str | None = None
    # vLLM's: structured outputs' backend and options ({"backend": "xgrammar"};
    # engine/structured/config.py); guided_decoding_backend is vLLM's older
    # name for the backend.
    structured_outputs_config: StructuredOutputsConfig | dict | None = None
    guided_decoding_backend: str | None = None
    # vLLM's LoRA options (engine/lora/): requests may name a PEFT adapter
    # (LoRARequest); up to max_loras adapters share a step, each in a device
    # slot sized for max_lora_rank, and max_cpu_loras (default max_loras) stay
    # in host memory behind them. lora_dtype "auto": the model's dtype.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: LoRADType = LoRADType.AUTO
    fully_sharded_loras: bool = False
    # vLLM's: speculative decoding ({"method": "ngram", "num_speculative_tokens":
    # k, ...}; engine/spec_decode/config.py). Steps are synchronous with it.
    speculative_config: SpeculativeConfig | dict | None = None
    # Derived in __post_init__.
    model_config: ModelArchConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._check_model()
        self._parse_names()
        self._check_memory()
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_logprobs", self.max_logprobs, 0)
        self._check_swap()
        _require_gib("cpu_offload_gb", self.cpu_offload_gb)
        for name in (
            "enforce_eager",
            "fused_ops",
            "piecewise_cuda_graphs",
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "skip_tokenizer_init",
            "late_launch",
            "enable_lora",
            "fully_sharded_loras",
            "calculate_kv_scales",
        ):
            _require_bool(name, getattr(self, name))
        if self.async_scheduling is not None:
            _require_bool("async_scheduling", self.async_scheduling)
        self._resolve_lengths()
        self.max_cpu_loras = check_lora_options(
            self.enable_lora,
            self.max_loras,
            self.max_lora_rank,
            self.max_cpu_loras,
            self.tensor_parallel_size,
            self.fully_sharded_loras,
        )
        self._check_speculation()
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).resolve().name

    def _check_model(self) -> None:
        """The model directory, its architecture, and its split over the ranks."""
        if not isinstance(self.model, str | os.PathLike) or not str(self.model):
            raise ValueError(f"model must be a path to a model directory; got {self.model!r}")
        self.model = str(self.model)
        if not Path(self.model).is_dir():
            raise ValueError(
                f"model: {self.model!r} is not a directory; pass a local Hugging Face model "
                "directory (`pdserve model prepare` makes the demo model)"
            )
        self.model_config = ModelArchConfig.from_dir(self.model)
        _require_int("seed", self.seed, 0, 2**63 - 1)
        _require_int("tensor_parallel_size", self.tensor_parallel_size)
        # Raises naming the reason when the model cannot be split over that many ranks.
        TPLayout.for_model(self.model_config, 0, self.tensor_parallel_size)

    def _parse_names(self) -> None:
        """The options given by name (vLLM's strings) as their enums and configs."""
        self.preemption_mode = _parse_enum("preemption_mode", self.preemption_mode, PreemptionMode)
        self.load_format = _parse_enum("load_format", self.load_format, LoadFormat)
        self.device = _parse_enum("device", self.device, DeviceKind)
        self.attention_backend = _parse_enum(
            "attention_backend", self.attention_backend, AttentionBackendName
        )
        self.gemv_backend = _parse_enum("gemv_backend", self.gemv_backend, GemvBackend)
        self.quantization = resolve_quantization(
            parse_quantization(self.quantization), self.model_config.checkpoint_quant
        )
        self.kv_cache_dtype = _parse_enum("kv_cache_dtype", self.kv_cache_dtype, KVCacheDType)
        self.lora_dtype = _parse_enum("lora_dtype", self.lora_dtype, LoRADType)
        self.structured_outputs_config = StructuredOutputsConfig.parse(
            self.structured_outputs_config, self.guided_decoding_backend
        )
        self.guided_decoding_backend = None  # folded into structured_outputs_config
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.worker_extension_cls is not None and not _EXTENSION_NAME.fullmatch(
            str(self.worker_extension_cls)
        ):
            raise ValueError(
                f"worker_extension_cls must be 'module:Class' or 'module.Class'; got "
                f"{self.worker_extension_cls!r}"
            )
        if self.dtype not in _DTYPE_ALIASES:
            allowed = ", ".join(repr(k) for k in _DTYPE_ALIASES)
            raise ValueError(f"dtype must be one of {allowed}; got {self.dtype!r}")
        self.dtype = _DTYPE_ALIASES[self.dtype]

    def _check_memory(self) -> None:
        """The KV cache's block size and how its size is chosen."""
        if self.kvcache_block_size not in ALLOWED_BLOCK_SIZES:
            raise ValueError(
                f"kvcache_block_size must be one of {ALLOWED_BLOCK_SIZES}; "
                f"got {self.kvcache_block_size!r}"
            )
        _require_int("num_kvcache_blocks", self.num_kvcache_blocks)
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(
                "num_kvcache_blocks must be -1 (size from available memory) or >= 1; "
                f"got {self.num_kvcache_blocks}"
            )
        if self.kv_cache_memory_bytes is not None:
            _require_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        util = self.gpu_memory_utilization
        if not isinstance(util, int | float) or isinstance(util, bool) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {util!r}")

    def _check_swap(self) -> None:
        """The host tier's size, and what needs one."""
        space = self.swap_space
        _require_gib("swap_space", space)
        if self.preemption_mode is PreemptionMode.SWAP and space == 0:
            raise ValueError('preemption_mode="swap" needs a host tier: set swap_space > 0')

    def _check_speculation(self) -> None:
        """What speculative decoding cannot be combined with (yet), refused at start."""
        spec = self.speculative_config
        if spec is None:
            return
        if self.async_scheduling:
            # A verify step's accepted length decides the next step's inputs and
            # block needs, so the next step cannot be planned before it is read.
            raise ValueError(
                "speculative_config needs synchronous steps: async_scheduling=True cannot be "
                "combined with it (leave async_scheduling unset or False)"
            )
        # With enable_lora a verify row's 1 + k positions all carry the
        # sequence's adapter (LoRAManager.plan_step); a draft model proposes
        # without it (docs/engine.md).
        if spec.method is SpeculativeMethod.DRAFT_MODEL:
            if self.model_config.freeing_window is not None:
                # Its blocks behind the window are freed; the draft's catch-up
                # over a whole prompt would write through them.
                raise ValueError(
                    "speculative_config method 'draft_model' is not supported for a model whose "
                    "every layer slides (its blocks behind the window are freed); use 'ngram'"
                )
            draft = ModelArchConfig.from_dir(spec.model)
            if draft.vocab_size != self.model_config.vocab_size:
                raise ValueError(
                    f"speculative_config.model's vocabulary ({draft.vocab_size} tokens) does not "
                    f"match the target model's ({self.model_config.vocab_size})"
                )
            tp = self.tensor_parallel_size
            if spec.draft_tensor_parallel_size not in (None, tp):
                raise ValueError(
                    f"speculative_config.draft_tensor_parallel_size "
                    f"{spec.draft_tensor_parallel_size} is not supported: the draft model is "
                    f"sharded over the target's ranks (tensor_parallel_size {tp}); leave it unset "
                    f"or give {tp}"
                )
            _check_draft_split(draft, tp)

    def _resolve_lengths(self) -> None:
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        _require_int("max_model_len", self.max_model_len, 2)
        if self.max_model_len > limit:
            logger.warning(
                "max_model_len %d is clipped to the model's max_position_embeddings %d",
                self.max_model_len,
                limit,
            )
            self.max_model_len = limit
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
                if self.enable_chunked_prefill
                else max(self.max_model_len, self.max_num_seqs)
            )
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is False, or the longest "
                "prompts could never be scheduled"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]

    def to_json(self) -> str:
        """The fields as JSON (Enums by value): how a tensor-parallel rank's
        process receives its engine's configuration, without pickle."""
        plain = {
            name: (v.value if isinstance(v := getattr(self, name), enum.Enum) else v)
            for name in self.field_names()
        }
        plain["structured_outputs_config"] = self.structured_outputs_config.to_dict()
        if self.speculative_config is not None:
            plain["speculative_config"] = self.speculative_config.to_dict()
        return json.dumps(plain)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        kwargs = json.loads(text)
        return cls.from_kwargs(kwargs.pop("model"), **kwargs)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {', '.join(unknown)}; "
                f"valid options: {', '.join(cls.field_names())}"
            )
        return cls(model=model, **kwargs)
