"""pdserve's shared code: the engine, models, layers, block hashing and cluster state.

``from common import LLM, SamplingParams`` is the offline API. The names are
resolved lazily so that light users of this package (the router hashing
blocks) do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.engine.llm import LLM
    from common.engine.outputs import CompletionOutput, RequestOutput
    from common.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "RequestOutputKind", "SamplingParams"]

_LAZY = {
    "LLM": "common.engine.llm",
    "SamplingParams": "common.engine.sampling_params",
    "RequestOutputKind": "common.engine.sampling_params",
    "RequestOutput": "common.engine.outputs",
    "CompletionOutput": "common.engine.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'common' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
