"""vLLM as a measured peer: the same workload through ``vllm.LLM`` in the same run.

Same prompts (token ids, as ``TokensPrompt``), output lengths, ``ignore_eos``,
temperature and seed, dummy weights of the same shape, no tokenizer and no
detokenization: the call that worked for vLLM 0.26.0 on the GPU host
(../shared/peers/vllm/README.md; benchmarks/README.md says how to carry it).
The argument translation is plain Python so a CPU test checks it without vLLM.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

VLLM_MISSING = (
    "--peer vllm needs the vllm package (0.26.0 was measured); it is not importable here. "
    "On the GPU host unpack it as benchmarks/README.md ('Carrying vLLM') describes "
    "and put it on PYTHONPATH, with VLLM_USE_FLASHINFER_SAMPLER=0"
)


def engine_kwargs(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments matching our engine's settings for ``args``."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
    }
    if args.dtype != "auto":
        kwargs["dtype"] = args.dtype
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    # The numerics under the names both engines take: FP8 weights quantized at
    # load, an FP8 KV cache (vLLM's own default scales, 1.0, as ours).
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    return kwargs


def workload(
    prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(TokensPrompt dicts, SamplingParams kwargs) for the same sequences as ours."""
    tokens_prompts = [{"prompt_token_ids": list(p)} for p in prompts]
    params = [
        {
            "temperature": args.temperature,
            "ignore_eos": True,
            "max_tokens": n,
            "detokenize": False,
        }
        for n in out_lens
    ]
    return tokens_prompts, params


def run_vllm(model_dir: Path, args, prompts, out_lens, profile_work=None) -> dict[str, Any]:
    """The timed run; with ``profile_work`` (prompts, output lengths) a second run
    under the kernel profiler. The profiler sees only its own process's kernels,
    so then vLLM's engine core runs in this process (its timed run too: the
    record says ``in_process``)."""
    if profile_work is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise SystemExit(f"{VLLM_MISSING} ({e})") from e

    llm = LLM(**engine_kwargs(model_dir, args))
    llm.generate(
        [{"prompt_token_ids": [1, 2, 3, 4]}],
        SamplingParams(max_tokens=4, detokenize=False),
        use_tqdm=False,
    )  # warm-up
    tokens_prompts, param_kwargs = workload(prompts, out_lens, args)
    params = [SamplingParams(**kw) for kw in param_kwargs]
    start = time.perf_counter()
    outs = llm.generate(tokens_prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != sum(out_lens):
        raise RuntimeError(f"vLLM produced {produced} tokens, expected {sum(out_lens)}")
    profiled = None
    if profile_work is not None:
        from benchmarks.kernel_profile import profile_kernels

        p_prompts, p_kwargs = workload(*profile_work, args)
        p_params = [SamplingParams(**kw) for kw in p_kwargs]
        _, profiled = profile_kernels(lambda: llm.generate(p_prompts, p_params, use_tqdm=False))
    # The KV pool vLLM sized (its engine core reports it back to this process).
    cache = llm.llm_engine.vllm_config.cache_config
    return {
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "in_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
        "profile": profiled,
        "version": vllm.__version__,
        "output_tokens": produced,
        "elapsed_s": elapsed,
        "output_tok_per_s": produced / elapsed,
        "total_tok_per_s": (produced + sum(map(len, prompts))) / elapsed,
        "engine_kwargs": engine_kwargs(model_dir, args),
    }
