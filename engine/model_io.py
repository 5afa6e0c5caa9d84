"""What goes into a model step and what comes out of it.

``ModelInputs`` is the device-side input of one forward (shared by the eager
path and the CUDA graphs); ``StepOutput`` is the plain-Python result the output
processor reads, so the scheduler and output processing stay free of torch
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.attention import AttentionMetadata
from engine.sequence import TokenLogprobs


@dataclass(slots=True)
class PromptTokenLogprob:
    """Logprob of prompt token ``token_id`` (at ``position``) given the tokens before it."""

    position: int
    token_id: int
    logprob: TokenLogprobs


@dataclass(slots=True)
class StepOutput:
    """One step's results, aligned with ``ScheduledBatch.seqs``."""

    sampled: list[int | None]  # None for a prefill chunk that is not the last
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[list[PromptTokenLogprob] | None]


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
