"""--peer vllm: our workload arguments translate to vLLM's call (no vLLM needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks import offline_throughput
from benchmarks.peers import vllm_peer


def gpu_args(*extra: str):
    args = offline_throughput.parse_args(["--num-seqs", "5", "--peer", "vllm", *extra])
    offline_throughput.resolve_defaults(args, on_gpu=True)
    return args


def test_engine_kwargs_are_the_call_that_worked():
    kwargs = vllm_peer.engine_kwargs(Path("/m"), gpu_args())
    assert kwargs == {
        "model": "/m",
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": 4096,
        "max_num_seqs": 256,
        "gpu_memory_utilization": 0.9,
        "seed": 0,
        "enforce_eager": False,
    }
    custom = vllm_peer.engine_kwargs(
        Path("/m"), gpu_args("--dtype", "float16", "--max-num-batched-tokens", "8192")
    )
    assert custom["dtype"] == "float16" and custom["max_num_batched_tokens"] == 8192


def test_workload_is_ours_token_for_token():
    args = gpu_args("--temperature", "0.7")
    prompts, out_lens = offline_throughput.make_workload(args, 151936)
    tokens_prompts, params = vllm_peer.workload(prompts, out_lens, args)
    assert [p["prompt_token_ids"] for p in tokens_prompts] == prompts
    assert [p["max_tokens"] for p in params] == out_lens
    assert all(
        p["ignore_eos"] and p["temperature"] == 0.7 and p["detokenize"] is False for p in params
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_missing_vllm_is_a_clear_error():
    prompts, out_lens = [[1, 2, 3]], [2]
    with pytest.raises(SystemExit, match="needs the vllm package"):
        vllm_peer.run_vllm(Path("/m"), gpu_args(), prompts, out_lens)
