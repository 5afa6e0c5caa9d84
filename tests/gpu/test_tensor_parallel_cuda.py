"""Tensor parallelism on GPUs (NCCL): TP = 2 gives TP = 1's greedy tokens, with
CUDA graphs (the all-reduce captured) and async scheduling on, and eagerly.

Run on a host with two or more GPUs: ``python -m pytest tests/gpu -m multi_gpu``.
Skipped elsewhere (the CPU path of the same code is tests/engine/test_tensor_parallel.py).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32001,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tp2_equals_tp1(tmp_path, enforce_eager):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    prompts = [{"prompt_token_ids": list(range(11 * i, 11 * i + 9 + 5 * i))} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=16,
            gpu_memory_utilization=0.3,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tp,
        )
        try:
            tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.llm_engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    assert tokens[2] == tokens[1]
