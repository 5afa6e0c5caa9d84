"""Prompt logprobs: which prompt positions a step scores, and their entries.

A position p's logits predict prompt token p + 1, so a prompt of n tokens has
n - 1 scored positions (the first token has no context). Only completion 0 of
a request scores its prompt: the others share it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.layers.sampler import top_logprobs
from engine.model_io import PromptTokenLogprob
from engine.sequence import Sequence, TokenLogprobs

# Full-vocabulary fp32 logits for a long chunk would be huge (8k x 152k x 4
# bytes = 4.6 GiB): they are computed a slice of positions at a time.
PROMPT_LOGPROBS_SLICE = 1024


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether this sequence still has prompt positions to score."""
    return (
        seq.num_computed_tokens < seq.num_prompt_tokens - 1
        and seq.params.prompt_logprobs is not None
        and seq.index == 0
    )


def prompt_logprob_parts(
    seqs: list[Sequence], num_new: list[int], qsl: np.ndarray
) -> list[tuple[int, int, int, int]]:
    """(batch row, first position, hidden lo, hidden hi) of each slice of
    prompt positions whose logits this step computes, in order."""
    parts = []
    for i, (seq, n) in enumerate(zip(seqs, num_new, strict=True)):
        # Only a chunk that still holds prompt positions has prompt logprobs.
        if not wants_prompt_logprobs(seq):
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)
        for lo in range(start, end, PROMPT_LOGPROBS_SLICE):
            hi = min(lo + PROMPT_LOGPROBS_SLICE, end)
            base = int(qsl[i]) - start
            parts.append((i, lo, base + lo, base + hi))
    return parts


def prompt_logprob_entries(
    seq: Sequence, lo: int, logits: torch.Tensor
) -> list[PromptTokenLogprob]:
    """Entries for prompt positions ``lo ..`` (one per row of ``logits``)."""
    hi = lo + logits.shape[0]
    targets = seq.token_ids[lo + 1 : hi + 1]
    lps = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(targets, device=logits.device)
    k = seq.params.prompt_logprobs
    lp, rank, top_ids, top_lp = (t.tolist() for t in top_logprobs(lps, chosen, k))
    return [
        PromptTokenLogprob(lo + 1 + j, tok, TokenLogprobs(lp[j], rank[j], top_ids[j], top_lp[j]))
        for j, tok in enumerate(targets)
    ]
