"""Structured outputs on CUDA with async scheduling (the default there): the
grammar bitmask applied on the device, a structured step's sampling deferred
behind the previous step's read, and the same tokens as the synchronous engine.
Run on a GPU host: ``python -m pytest tests/gpu/test_structured_outputs_cuda.py -m gpu``."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.sampler import GrammarBitmask, apply_token_bitmask
from engine.sampling_params import StructuredOutputsParams as S
from tests.conftest import needs_demo_model
from tests.engine.conftest import assert_idle

pytestmark = pytest.mark.gpu
jsonschema = pytest.importorskip("jsonschema")

INT = {"type": "integer", "minimum": 0, "maximum": 99}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": INT},
        "required": ["name", "age"],
    },
    {"type": "array", "items": INT, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"d": {"type": "string", "format": "date"}},
        "required": ["d"],
    },
    {"anyOf": [INT, {"type": "string", "enum": ["low", "high"]}]},
]


def _packed(allowed: torch.Tensor) -> torch.Tensor:
    rows, vocab = allowed.shape
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_on_cuda_matches_the_cpu():
    gen = torch.Generator().manual_seed(0)
    vocab = 49152 + 17
    allowed = torch.rand(4, vocab, generator=gen) > 0.97
    bits = _packed(allowed).pin_memory()
    logits = torch.randn(6, vocab, generator=gen)
    on_cpu = logits.clone()
    apply_token_bitmask(on_cpu, GrammarBitmask(bits, [0, 2, 3, 5]))
    on_gpu = logits.cuda()
    apply_token_bitmask(on_gpu, GrammarBitmask(bits, [0, 2, 3, 5]))
    assert torch.equal(on_gpu.cpu(), on_cpu)


def _run(demo_model_dir, async_scheduling: bool, params, prompts):
    llm = LLM(
        str(demo_model_dir),
        device="cuda",
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        async_scheduling=async_scheduling,
    )
    engine = llm.llm_engine
    assert engine.async_scheduling is async_scheduling
    # Steps whose sampling waited for the previous step's read (the deferred half).
    deferred = 0
    launch = engine.structured.launch

    def counting(*args):
        nonlocal deferred
        step, read = launch(*args)
        deferred += read is not None
        return step, read

    engine.structured.launch = counting
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert (deferred > 0) is async_scheduling
    assert_idle(llm)
    assert engine.num_grammar_matchers == 0
    result = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return result


@needs_demo_model
def test_async_scheduling_gives_the_synchronous_tokens(demo_model_dir):
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS * 4):
        prompts.append(f"Answer {i} in JSON:")
        hot = i >= len(SCHEMAS) * 2
        params.append(
            SamplingParams(
                temperature=1.0 if hot else 0.0,
                seed=i if hot else None,
                max_tokens=48,
                structured_outputs=S(json=schema, disable_any_whitespace=True),
            )
        )
    # Unconstrained and regex rows in the same batches.
    prompts += ["Tell me a story.", "Phone:"]
    params += [
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        SamplingParams(
            temperature=0, max_tokens=16, structured_outputs=S(regex=r"\+1 [0-9]{3}-[0-9]{4}")
        ),
    ]
    sync = _run(demo_model_dir, False, params, prompts)
    overlapped = _run(demo_model_dir, True, params, prompts)
    assert overlapped == sync
    for (_, text, reason), schema in zip(sync, SCHEMAS * 4, strict=False):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
