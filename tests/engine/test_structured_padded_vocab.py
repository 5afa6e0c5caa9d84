"""Structured outputs on a model whose vocabulary is padded past its tokenizer's
(Llama-3.1-8B's 128256 rows over a smaller tokenizer; many checkpoints round
the embedding up to a multiple of 64): the ids past the tokenizer have logits,
have no text, and a grammar must never let one through.

A tiny random Llama with the demo model's tokenizer and 128 padded rows whose
lm_head weights are made to win: unconstrained greedy decoding picks them
(so the check below could fail), constrained decoding never does, and its
outputs validate against their schemas.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams as S
from tests.conftest import TINY_CONFIGS
from tests.engine.conftest import assert_idle

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PADDING = 128
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["name", "age"],
    },
    {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
]


@pytest.fixture(scope="module")
def padded(tmp_path_factory, demo_model_dir, demo_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    real = len(demo_tokenizer)
    shape = {
        k: v for k, v in TINY_CONFIGS["llama"].items() if k not in ("architectures", "model_type")
    }
    config = LlamaConfig(
        **(shape | {"vocab_size": real + PADDING}),
        bos_token_id=demo_tokenizer.bos_token_id,
        eos_token_id=demo_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # the padded rows' logits dwarf every real token's
        model.lm_head.weight[real:].mul_(1000.0)
    out = tmp_path_factory.mktemp("padded-vocab")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(demo_model_dir / name, out / name)
    llm = LLM(str(out), device="cpu", max_model_len=256, seed=0)
    return llm, real


def test_the_padded_rows_win_unconstrained(padded, demo_tokenizer):
    llm, real = padded
    prompt = demo_tokenizer.encode("Reply with JSON only.")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.llm_engine.config.model_config.vocab_size == real + PADDING
    assert all(t >= real for t in out[0].outputs[0].token_ids)


def test_a_grammar_never_lets_a_padded_id_through(padded, demo_tokenizer):
    llm, real = padded
    prompt = demo_tokenizer.encode("Reply with JSON only.")
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(
                temperature=temperature,
                seed=7,
                max_tokens=96,
                structured_outputs=S(json=schema, disable_any_whitespace=True),
            )
            for schema in SCHEMAS
        ]
        outs = llm.generate([prompt] * len(SCHEMAS), params)
        for schema, out in zip(SCHEMAS, outs, strict=True):
            done = out.outputs[0]
            assert done.finish_reason == "stop", (schema, done)
            assert all(t < real for t in done.token_ids), done.token_ids
            jsonschema.validate(json.loads(done.text), schema)
    assert_idle(llm)
    assert llm.llm_engine.num_grammar_matchers == 0
