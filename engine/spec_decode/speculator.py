"""The engine's host side of speculative decoding: proposals before a step,
acceptance after it, and the counters the engine's stats report. Torch-free.

A sequence's proposal lives in ``seq.spec_token_ids`` (vLLM's name), never in
``token_ids``: the scheduler gives the sequence ``1 + len(spec_token_ids)``
query positions, the runner samples each of them (engine/spec_decode/
verify_rows.py), and ``accept`` keeps the proposed tokens up to the first one
the target sampled differently. Nothing unverified is ever counted computed
or hashed, so no prefix-cache block can hold it; the KV written at rejected
positions lies past ``num_computed_tokens`` and is overwritten later, and the
blocks that only held it go back to the pool (``BlockManager.trim``).

Why sampling each position and comparing is exact: a proposal is one token
``d`` (a one-hot draft distribution), and rejection sampling accepts ``d``
with probability ``p(d)`` and otherwise samples from ``p`` without ``d``,
renormalised; drawing ``t ~ p`` and keeping ``d`` iff ``t == d`` (else
emitting ``t``) gives every token exactly the same probability. Under greedy
sampling ``t`` is the argmax, so the output is token for token the
non-speculative one.

``Speculator.draft`` (a ``DraftProposer``) is where proposals come from for
method draft_model: any callable of that type may stand there, which is how
benchmarks/spec_decode.py replays known tokens around the draft model's
(dummy weights never agree) without a product flag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from engine.spec_decode.ngram import NgramProposer

# The draft model's proposer: k tokens for each sequence (engine/spec_decode/draft_model.py).
DraftProposer = Callable[[list[Sequence], int], list[list[int]]]
# How many leading proposed tokens a structured sequence's grammar allows
# (engine/structured/manager.py: ``valid_prefix``).
GrammarCheck = Callable[[Sequence, list[int]], int]


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start (vLLM's metric names, without the prefix)."""

    num_drafts: int = 0  # sequences that verified a proposal
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens the target kept
    # accepted_per_pos[i]: proposals whose token i was accepted.
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step of a sequence (accepted + the target's own)."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    def acceptance_per_position(self) -> list[float]:
        """Of the proposals, the share whose token i was accepted."""
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_pos),
        )


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        block_manager: BlockManager,
        draft: DraftProposer | None = None,
        grammar_check: GrammarCheck | None = None,
    ) -> None:
        """``draft``: the draft model's batch proposer (method draft_model);
        ``grammar_check``: cuts a structured sequence's proposal at the first
        token its grammar rejects (without it, such sequences propose nothing)."""
        self.block_manager = block_manager
        self.grammar_check = grammar_check
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.max_model_len = max_model_len
        self.ngram: NgramProposer | None = None
        if config.method is SpeculativeMethod.NGRAM:
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif draft is None:
            raise ValueError("speculative method 'draft_model' needs the draft model's proposer")
        self.draft = draft
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)

    def propose(self, running: list[Sequence]) -> None:
        """Fill ``spec_token_ids`` of the running sequences that decode next step."""
        if self.disable_by_batch_size is not None and len(running) >= self.disable_by_batch_size:
            return
        by_k: dict[int, list[Sequence]] = {}  # draft model: one batch per proposal length
        structured: list[Sequence] = []
        for seq in running:
            if (
                seq.status is not SequenceStatus.RUNNING
                or len(seq.token_ids) - seq.num_computed_tokens != 1
                or seq.awaiting_grammar
                or seq.params.disable_spec_decode  # the request opted out
            ):
                continue
            if seq.params.structured_outputs is not None:
                if self.grammar_check is None:
                    continue
                structured.append(seq)
            k = min(self.k, self._room(seq))
            if k <= 0:
                continue
            if self.ngram is not None:
                seq.spec_token_ids = self.ngram.propose(seq.token_ids, k)
            else:
                by_k.setdefault(k, []).append(seq)
        for k, seqs in by_k.items():
            self._propose_by_draft(seqs, k)
        for seq in structured:
            self._cut_at_grammar(seq)

    def _cut_at_grammar(self, seq: Sequence) -> None:
        """Keep the proposal up to the first token the grammar rejects: a
        verify could never keep it, nor anything after it."""
        spec = seq.spec_token_ids
        if not spec:
            return
        num = self.grammar_check(seq, spec)
        if num < len(spec):
            del spec[num:]
            if not spec:  # a draft's claim on blocks for the cut positions
                self.block_manager.trim(seq, len(seq.token_ids))

    def _propose_by_draft(self, seqs: list[Sequence], k: int) -> None:
        """The draft writes its KV up to the proposal's second-last position:
        the blocks for the whole verify are claimed now (what a verify rejects
        goes back after it; a sequence that gets none proposes nothing)."""
        bm = self.block_manager
        ready = [s for s in seqs if bm.allocate_slots(s, 1 + k)]
        if ready:
            for seq, proposal in zip(ready, self.draft(ready, k), strict=True):
                seq.spec_token_ids = proposal

    def _room(self, seq: Sequence) -> int:
        """Proposed tokens that can still be kept: a step emits up to k + 1
        tokens, and none may pass max_tokens or max_model_len."""
        num = len(seq.token_ids)
        room = self.max_model_len - num - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - (num - seq.num_prompt_tokens) - 1)
        return room

    def record(self, num_proposed: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_proposed
        s.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            s.accepted_per_pos[i] += 1

    def drop_unscheduled(self, running: list[Sequence], scheduled: list[Sequence]) -> None:
        """Forget the proposals of sequences the step left out (token budget)."""
        ids = {s.seq_id for s in scheduled}
        for seq in running:
            if seq.spec_token_ids and seq.seq_id not in ids:
                seq.spec_token_ids = []
                self.block_manager.trim(seq, len(seq.token_ids))  # a draft's claim

    def accept(
        self,
        seq: Sequence,
        drafts: list[int],
        samples: list[int],
        logprobs: list,
        first: int,
        emit: Callable[[Sequence, int, Any], None],
    ) -> int:
        """After the step's first sample (``samples[first]``) was appended and
        emitted: keep the proposal up to the first token the target sampled
        differently, appending the target's sample after each kept one, until a
        stop condition ends the sequence. Returns how many tokens it appended.

        ``samples[first + i]`` was sampled after ``drafts[:i]``: it decides
        ``drafts[i]`` and, when ``drafts[i]`` is kept, is the token emitted for
        the next position. A sequence that ended meanwhile (a stop, max_tokens)
        freed its blocks; otherwise the blocks past its tokens go back.
        """
        accepted = num_accepted(drafts, samples, first)
        self.record(len(drafts), accepted)
        appended = 0
        for i in range(accepted):
            if seq.status is SequenceStatus.FINISHED:
                break  # the rest of the accepted run is past its stop
            # drafts[i]'s KV, written this step, is verified: count it computed.
            seq.num_computed_tokens += 1
            token = samples[first + i + 1]
            seq.token_ids.append(token)
            appended += 1
            emit(seq, token, logprobs[first + i + 1])
        if seq.status is not SequenceStatus.FINISHED:
            self.block_manager.trim(seq, len(seq.token_ids))
        return appended


def num_accepted(drafts: list[int], samples: list[int], first: int) -> int:
    """How many leading proposed tokens the target kept: ``drafts[i]`` is kept
    while every sample before it agreed (``samples[first + i] == drafts[i]``)."""
    accepted = 0
    for i, d in enumerate(drafts):
        if samples[first + i] != d:
            break
        accepted += 1
    return accepted
