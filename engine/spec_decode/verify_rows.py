"""The runner's side of a verify step: which hidden rows give logits, which
sampling rows sample them, and the seeded generators' draws.

A sequence with ``k`` proposed tokens runs ``k + 1`` query positions in the
step (its last sampled token, then the proposal), attending to its KV prefix
like a chunk of a chunked prefill: every attention backend already takes
several query tokens per sequence there (the Triton backend routes such rows
through its varlen prefill kernel, not its one-token decode kernel; CUDA
graphs replay decode-only steps, so verify steps run eagerly or piecewise).
Each of the ``k + 1`` positions is sampled as its own row, with the context a
non-speculative step would have had there (penalties and ``min_tokens`` see
the proposed tokens before it), so each row's distribution, logprobs and
greedy choice are exactly the non-speculative ones.

A seeded request's generator is rewound after the step to where it would be
after one draw per emitted token, as if it had not speculated: its output is
then the same whether or not, and however much, it speculated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.layers.sampler import SamplingRow
from engine.sequence import Sequence


@dataclass(slots=True)
class SeededDraws:
    """A seeded speculating sequence's generator as it was before the step."""

    seq: Sequence
    generator: torch.Generator
    state: torch.Tensor
    num_tokens_before: int  # len(token_ids) when sampled (its placeholder not yet added)


@dataclass(slots=True)
class VerifyLayout:
    """Where a step's sampled rows lie among its sample rows."""

    first: list[int]  # per sampled batch row (in sampling order): its first sample row
    num_rows: int
    seeded: list[SeededDraws] = field(default_factory=list)


def verify_layout(
    query_start_loc: np.ndarray, sampling: list[int], seqs: list[Sequence]
) -> tuple[VerifyLayout, np.ndarray] | None:
    """The layout and the hidden rows to take logits from (None: no row
    speculates, one logits row per sampled sequence as usual)."""
    counts = [len(seqs[i].spec_token_ids) + 1 for i in sampling]
    if all(c == 1 for c in counts):
        return None
    ends = query_start_loc[1:][sampling]  # one past each sampled row's last token
    count = np.asarray(counts, dtype=np.int64)
    first = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(count[:-1], out=first[1:])
    total = int(count.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(first, count)
    rows = np.repeat(ends - count, count) + offsets
    return VerifyLayout(first.tolist(), total), rows


def expand_rows(
    layout: VerifyLayout, rows: list[SamplingRow], seqs: list[Sequence]
) -> list[SamplingRow]:
    """One sampling row per sample row: position ``i`` of a proposal sees the
    sequence's tokens and the proposed tokens before ``i``. Seeded generators'
    states are kept for ``settle_generators``."""
    out: list[SamplingRow] = []
    for row, seq in zip(rows, seqs, strict=True):
        out.append(row)
        spec = seq.spec_token_ids
        if not spec:
            continue
        if row.generator is not None and not row.params.greedy:
            state = row.generator.get_state()
            layout.seeded.append(SeededDraws(seq, row.generator, state, len(seq.token_ids)))
        for i in range(1, len(spec) + 1):
            out.append(
                SamplingRow(
                    row.params,
                    seq.token_ids + spec[:i],
                    row.num_prompt_tokens,
                    row.generator,
                    row.min_tokens_stop_ids,
                    row.device_masks,
                )
            )
    return out


def settle_generators(layout: VerifyLayout, vocab_size: int, device: torch.device) -> None:
    """Rewind each seeded generator to one draw per token its sequence emitted
    in the step (the sampler draws one vocabulary-sized row per sample)."""
    for s in layout.seeded:
        if s.seq.is_finished:
            continue  # its generator is gone with it
        emitted = len(s.seq.token_ids) - s.num_tokens_before
        s.generator.set_state(s.state)
        for _ in range(emitted):
            torch.empty(vocab_size, device=device).exponential_(generator=s.generator)
