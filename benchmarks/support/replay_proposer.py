"""A benchmark's draft proposer that knows the answer: it replays the target's
own greedy tokens, recorded in a non-speculative pass over the same prompts,
each corrupted with a chosen probability (benchmarks/spec_decode.py, part
``mechanics``).

Dummy weights make a draft model that never agrees with its target, so a
dummy-weight run could only measure 0% acceptance. The replay plugs into the
engine where the draft model's proposer does (``Speculator.draft``, a
``DraftProposer``), after running the draft model itself for its cost (its
forwards and KV writes), and proposes the recorded tokens instead of the
draft's. ``acceptance`` is the chance that each proposed token is the
target's (the per-token acceptance of the speculative decoding literature):
a token is kept only when every one before it in the proposal was, so the
share of proposed tokens kept (vLLM's acceptance rate, which the benchmark
reports as observed) is lower than ``acceptance`` between 0 and 1. Whether a
position is corrupted is drawn once per run and position (seeded), so a
position proposed again after an earlier rejection keeps its fate. Torch-free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine.sequence import Sequence
from engine.spec_decode.speculator import DraftProposer


@dataclass(slots=True)
class ReplayRun:
    """One run's answers: per prompt, the greedy tokens and which are corrupted."""

    references: dict[tuple[int, ...], list[int]]
    corrupted: dict[tuple[int, ...], list[bool]]


@dataclass(slots=True)
class ReplayProposer:
    inner: DraftProposer | None  # the draft model's proposer, run for its cost
    vocab_size: int
    run: ReplayRun | None = None
    # seq_id -> its prompt (the key of its answers), looked up once per sequence.
    _prompt_of: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def start_run(
        self, prompts: list[list[int]], references: list[list[int]], acceptance: float, seed: int
    ) -> None:
        """Answers for the next ``generate``: ``references[i]`` follows ``prompts[i]``."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be within [0, 1]; got {acceptance}")
        keys = [tuple(p) for p in prompts]
        if len(set(keys)) != len(keys):
            raise ValueError("the replay tells sequences apart by prompt: prompts must differ")
        rng = random.Random(seed)
        pairs = list(zip(keys, references, strict=True))
        self.run = ReplayRun(
            dict(pairs), {key: [rng.random() >= acceptance for _ in ref] for key, ref in pairs}
        )
        self._prompt_of.clear()

    def __call__(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        if self.run is None:
            raise RuntimeError("ReplayProposer.start_run must come before a speculative run")
        if self.inner is not None:
            self.inner(seqs, k)  # the draft's work happens; its tokens are not used
        return [self._replay(seq, k) for seq in seqs]

    def _replay(self, seq: Sequence, k: int) -> list[int]:
        if not seq.params.greedy:
            raise ValueError("the replay proposes greedy tokens: it needs greedy requests")
        key = self._prompt_of.get(seq.seq_id)
        if key is None:
            key = self._prompt_of[seq.seq_id] = tuple(seq.token_ids[: seq.num_prompt_tokens])
        # The sequence's last token (sampled, not yet computed) is output
        # position ``pos - 1``: the proposal starts at ``pos``.
        pos = len(seq.token_ids) - seq.num_prompt_tokens
        ref = self.run.references[key][pos : pos + k]
        bad = self.run.corrupted[key][pos : pos + k]
        return [(t + 1) % self.vocab_size if b else t for t, b in zip(ref, bad, strict=True)]
