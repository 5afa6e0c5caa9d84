"""vLLM's n-gram speculative decoding as a measured peer (benchmarks/spec_decode.py,
part ``ngram``): the same prompts (token ids), greedy, the same ``max_tokens``
and batches, real weights and vLLM's own tokenizer load, prefix caching off as
in pdserve's runs. The argument translation is plain Python so a CPU test
checks it without vLLM.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

from benchmarks.peers.vllm_peer import VLLM_MISSING

# vLLM's spec-decode counters (``LLM.get_metrics``; prometheus adds ``_total``).
_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def engine_kwargs(
    model_dir: Path, args: argparse.Namespace, speculative_config: dict | None
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments matching pdserve's engine for this part."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "max_model_len": args.max_model_len,
        "max_num_seqs": max(args.batch_sizes),
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": False,
        "disable_log_stats": False,  # the spec-decode counters
    }
    if args.dtype != "auto":
        kwargs["dtype"] = args.dtype
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    return kwargs


def spec_counters(metrics: list[Any]) -> dict[str, float]:
    """The spec-decode counters of a ``get_metrics`` snapshot, summed over labels."""
    totals = dict.fromkeys(_COUNTERS.values(), 0.0)
    for metric in metrics:
        name = _COUNTERS.get(metric.name.removesuffix("_total"))
        if name is not None:
            totals[name] += metric.value
    return totals


def open_vllm(model_dir: Path, args: argparse.Namespace, speculative_config: dict | None):
    """A warmed-up ``vllm.LLM`` and its ``SamplingParams`` class."""
    try:
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise SystemExit(f"{VLLM_MISSING} ({e})") from e
    llm = LLM(**engine_kwargs(model_dir, args, speculative_config))
    llm.generate(
        [{"prompt_token_ids": [1, 2, 3, 4]}],
        SamplingParams(max_tokens=4, detokenize=False),
        use_tqdm=False,
    )
    return llm, SamplingParams


def close_vllm(llm: Any) -> None:
    """Let the next engine of the run size its cache on a free GPU."""
    import torch

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def vllm_version() -> str:
    import vllm

    return vllm.__version__
