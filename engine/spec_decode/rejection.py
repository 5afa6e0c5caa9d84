"""Rejection sampling of a draft model's sampled proposals (speculative
sampling; vLLM v1's ``RejectionSampler`` for draft probabilities).

At temperature > 0 the draft model samples proposal token ``d_i`` from its
own distribution ``q_i``; the target's distribution at that position is
``p_i``, after every step the sampler applies (masks, penalties, temperature,
min_p, top-k/top-p). ``d_i`` is kept with probability ``min(1, p_i(d_i) /
q_i(d_i))``; the first position that rejects emits a token drawn from
``norm(max(0, p_i - q_i))`` instead; when every ``d_i`` is kept, the last
position's ordinary sample (drawn from ``p_k``) is the bonus token. Each
emitted token is then distributed exactly as without speculation.

A proposal whose ``q`` is one-hot (the n-gram proposer, a greedy draft) needs
none of this: its positions are sampled from ``p`` and compared
(engine/spec_decode/speculator.py), which is this same rule with ``q(d) = 1``.

The result is written into the step's sample rows, where the host's
acceptance reads it (keep ``d_i`` while the row's sample equals it): a kept
``d_i``'s row holds ``d_i``, a rejected one's the recovered token, which is
never ``d_i`` (rejection needs ``p(d) < q(d)``, where the residual is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DraftProbs:
    """A verify step's sampled proposals: one entry per proposed position."""

    rows: torch.Tensor  # [n] int64: each position's sample row in the step
    token_ids: torch.Tensor  # [n] int64: the proposed tokens
    probs: torch.Tensor  # [n, vocab] float32: the draft distribution each came from
    # Per position: the request's own generator (a seeded request), or None.
    generators: list[torch.Generator | None]


def rejection_sample(
    target_probs: torch.Tensor,
    sampled: torch.Tensor,
    draft: DraftProbs,
    generator: torch.Generator,
) -> torch.Tensor:
    """``sampled`` (one token per sample row, drawn from ``target_probs``)
    with each proposed position replaced by its kept proposal or its
    recovered token. ``generator`` draws for requests without their own."""
    p = target_probs[draft.rows]
    q = draft.probs.to(p.dtype)
    d = draft.token_ids.unsqueeze(1)
    p_d = p.gather(1, d).squeeze(1)
    q_d = q.gather(1, d).squeeze(1)
    uniform = torch.empty_like(p_d)
    expo = torch.empty_like(p)
    uniform.uniform_(generator=generator)
    expo.exponential_(generator=generator)
    for i, gen in enumerate(draft.generators):
        if gen is not None:
            uniform[i].uniform_(generator=gen)
            expo[i].exponential_(generator=gen)
    # Kept with probability min(1, p(d) / q(d)); q(d) > 0, d was drawn from q.
    keep = uniform * q_d <= p_d
    residual = (p - q).clamp_(min=0.0)
    # All zero only where p == q, where nothing is rejected: any row will do.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    expo.clamp_(min=torch.finfo(expo.dtype).tiny)
    recovered = (residual / expo).argmax(dim=1)
    out = sampled.clone()
    out[draft.rows] = torch.where(keep, draft.token_ids, recovered)
    return out
