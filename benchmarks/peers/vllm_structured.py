"""vLLM as the peer of benchmarks/structured_outputs.py: the same runs (prompts,
parameters, schema) through ``vllm.LLM`` in the same process.

The engine is the one ``vllm_peer.engine_kwargs`` builds for the offline
benchmark, but with its tokenizer (vLLM compiles grammars from it: it refuses
structured outputs under ``skip_tokenizer_init``) and xgrammar named as the
backend, pdserve's. The schema goes as vLLM 0.26.0 takes it:
``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.peers.vllm_peer import VLLM_MISSING, engine_kwargs
from benchmarks.structured_outputs import (
    FIRST_PROMPT_ID,
    NESTED_SCHEMA,
    WARM_UP_TOKENS,
    pair_runs,
    param_kwargs,
    run_rows,
)


def structured_engine_kwargs(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: the offline benchmark's, with the tokenizer."""
    kwargs = engine_kwargs(model_dir, args)
    kwargs["skip_tokenizer_init"] = False
    kwargs["structured_outputs_config"] = {"backend": "xgrammar"}
    return kwargs


def run_vllm_structured(
    model_dir: Path, args: argparse.Namespace, work: list[dict[str, Any]]
) -> dict[str, Any]:
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError as e:
        raise SystemExit(f"{VLLM_MISSING} ({e})") from e

    llm = LLM(**structured_engine_kwargs(model_dir, args))

    def generate(prompts: list[list[int]], constrained: bool, max_tokens: int | None = None):
        so = StructuredOutputsParams(json=NESTED_SCHEMA) if constrained else None
        params = SamplingParams(
            **param_kwargs(args, constrained, max_tokens), structured_outputs=so
        )
        tokens = [{"prompt_token_ids": p} for p in prompts]
        return llm.generate(tokens, params, use_tqdm=False)

    for constrained in (False, True):  # the second compiles the schema, cached after
        generate([[FIRST_PROMPT_ID] * 4], constrained, WARM_UP_TOKENS)
    runs = [
        run_rows(lambda p, c=w["constrained"]: generate(p, c), w, args.max_tokens) for w in work
    ]
    return {
        "runs": runs,
        "by_batch": pair_runs(runs),
        "version": vllm.__version__,
        "engine_kwargs": structured_engine_kwargs(model_dir, args),
    }
