"""The LLM engine: config, sampling parameters, sequences, block hashing, block
manager, scheduler, model runner, CUDA graphs, the step-level ``LLMEngine`` and
the offline ``LLM`` API, with ``models/`` and ``layers/``.

It imports nothing of the service (router, nodes, ``common``): the service is
built on it, never the other way round (docs/architecture.md, "Layout").

``from engine import LLM, SamplingParams`` is the offline API. The names are
resolved lazily so that light users of this package (the router, which
validates requests and hashes blocks with the engine's own torch-free code) do
not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import (
        GuidedDecodingParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]

_LAZY = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "StructuredOutputsParams": "engine.sampling_params",
    "GuidedDecodingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "LoRARequest": "engine.lora.request",
    "CompletionOutput": "engine.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
