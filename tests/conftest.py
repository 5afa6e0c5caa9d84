"""Shared fixtures: the demo model, tiny random HF models, GPU markers."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (make test's workers), a worker computes on one thread:
# two workers with torch's default threads each would oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# Without a GPU, Triton kernels run under Triton's interpreter (on CPU tensors).
# It must be chosen before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
# Router flags that send every prompt to a prefill node (no local prefill on
# the decode node), for tests of the prefill -> decode hand-off.
REMOTE_PREFILL_ONLY = ["--local-prefill-max-tokens", "0", "--local-prefill-min-hit", "1.0"]

# Tiny shapes of each supported architecture (fast on a CPU, all code paths).
TINY_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    "llama3-rope-tied": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    # Every layer slides: a 12-token window, shorter than the test prompts.
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        sliding_window=12,
    ),
    # Sliding and global layers interleaved (each with its RoPE), soft caps,
    # Gemma's norms and embedding scale.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=0.5,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    # A shared expert behind a sigmoid gate, top-k weights not renormalised.
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
    # Layer 1 dense (mlp_only_layers), the others 8 experts, top-2 renormalised.
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
    ),
}
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")


def build_tiny_hf_model(
    kind: str,
    out_dir: Path,
    seed: int = 0,
    max_shard_size: str | None = None,
    overrides: dict | None = None,
):
    """A random HF model of a tiny shape (``overrides`` changing some of its
    fields), saved as safetensors; returns the HF model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(TINY_CONFIGS[kind], **(overrides or {}))
    model_type = raw.pop("model_type")
    raw.pop("architectures")
    config = AutoConfig.for_model(model_type, **raw)
    torch.manual_seed(seed)
    # Eager attention: the one HF path that soft-caps attention scores (Gemma).
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # HF initialises with std 0.02: give the norms and biases random values too so
    # the test sees their effect, and make the routers decisive (the top-k choice
    # matters then, not a near-uniform spread).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(
                    1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p)
                )
            elif re.search(r"\.gate\.weight$", name):
                p.mul_(50.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory: tiny_model(kind) -> (model_dir, hf_model), cached for the session."""
    cache: dict[tuple, tuple[Path, object]] = {}

    def make(kind: str, max_shard_size: str | None = None):
        key = (kind, max_shard_size)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{kind}")
            cache[key] = (out, build_tiny_hf_model(kind, out, max_shard_size=max_shard_size))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model) -> Path:
    return tiny_model("llama")[0]


# GPU tests on the demo model skip on a host without it (a GPU host runs the
# tests from a checkout, without `make model`); CI prepares it.
needs_demo_model = pytest.mark.skipif(
    not (DEMO_MODEL_DIR / "config.json").is_file(),
    reason="the demo model is not prepared on this host (make model)",
)


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The demo model (SmolLM2-135M-Instruct), prepared on first use (idempotent)."""
    from engine.models.prepare import prepare_demo_model

    path, _ = prepare_demo_model(DEMO_MODEL_DIR)
    return path


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="session")
def hf_demo(demo_model_dir):
    """HF transformers on the demo model, fp32: the correctness oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


def hf_greedy_ids(hf_model, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of ``ids`` (token ids)."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            top_p=None,
            top_k=None,
        )
    return out[0, len(ids) :].tolist()


def write_config_dir(tmp_path: Path, raw: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


# Modules of live clusters, the longest first: make test's workers take whole
# modules in collection order, and a long module started last would run on
# alone at the end.
LONG_MODULES_FIRST = (
    "tests/faults/test_self_healing.py",
    "tests/integration/test_openai_compat.py",
    "tests/integration/test_structured_outputs.py",
    "tests/faults/",
    "tests/integration/",
)


def _start_order(item) -> int:
    path = item.nodeid.split("::")[0]
    for rank, prefix in enumerate(LONG_MODULES_FIRST):
        if path.startswith(prefix):
            return rank
    return len(LONG_MODULES_FIRST)


def pytest_collection_modifyitems(config, items):
    """The long modules first (LONG_MODULES_FIRST); GPU tests skip cleanly
    (with a reason) where CUDA is missing."""
    items.sort(key=_start_order)  # stable: a module's tests keep their order
    try:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover - torch missing entirely
        num_gpus = 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    # Markers, not keywords: a keyword match would also skip any test whose
    # parameter id or node name is "gpu" (tests/deploy has an overlay called gpu).
    for item in items:
        if item.get_closest_marker("multi_gpu") and num_gpus < 2:
            item.add_marker(skip_multi)
        elif item.get_closest_marker("gpu") and num_gpus < 1:
            item.add_marker(skip_gpu)


def teacher_forced(llm, ids: list[int]) -> tuple[list[int], list[float]]:
    """(top-1 token, logprob of the actual next token) at every position of
    ``ids`` after the first: what agreement and perplexity are measured on."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    top, actual = [], []
    for pos in range(1, len(ids)):
        lps = out.prompt_logprobs[pos]
        top.append(next(t for t, lp in lps.items() if lp.rank == 1))
        actual.append(lps[ids[pos]].logprob)
    return top, actual


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))
