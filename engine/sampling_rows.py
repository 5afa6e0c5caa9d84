"""Each sequence's sampling row and seeded generator, kept for its whole life."""

from __future__ import annotations

import torch

from engine.layers.sampler import SamplingRow
from engine.sequence import Sequence, SequenceStatus


class SamplingRows:
    """One row per sequence for its whole life: its facts do not change, and it
    holds the sequence's own token list (penalties read it as it grows)."""

    def __init__(
        self, device: torch.device, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._rows: dict[int, SamplingRow] = {}
        self._generators: dict[int, torch.Generator] = {}

    def __len__(self) -> int:
        """Sequences with a row kept (none at idle)."""
        return len(self._rows)

    def get(self, seq: Sequence) -> SamplingRow:
        row = self._rows.get(seq.seq_id)
        if row is not None:
            return row
        p = seq.params
        if seq.status is SequenceStatus.FINISHED:
            # It ended on the step read just before this one sampled (a
            # structured step's deferred sampling): its token is dropped. The
            # row is not kept and has no generator: nothing outlives it.
            return SamplingRow(p, seq.token_ids, seq.num_prompt_tokens, None, [])
        stop_ids: list[int] = []
        if p.min_tokens > 0:
            if not p.ignore_eos:
                stop_ids.extend(self.eos_token_ids)
            stop_ids.extend(p.stop_token_ids or ())
        row = SamplingRow(
            params=p,
            token_ids=seq.token_ids,
            num_prompt_tokens=seq.num_prompt_tokens,
            generator=self._generator_for(seq),
            min_tokens_stop_ids=stop_ids,
        )
        self._rows[seq.seq_id] = row
        return row

    def _generator_for(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            # Completion i of an n>1 request uses seed + i, so they differ.
            gen.manual_seed((seq.params.seed + seq.index) & 0xFFFF_FFFF_FFFF_FFFF)
            if not seq.params.greedy:
                # Tokens already there were sampled elsewhere (a prefill node's first
                # token, a migrated stream's earlier tokens): skip their draws so
                # the stream matches a single node's.
                for _ in range(seq.num_output_tokens + seq.params.resume_offset):
                    torch.empty(self.vocab_size, device=self.device).exponential_(generator=gen)
            self._generators[seq.seq_id] = gen
        return gen

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self._rows.pop(seq.seq_id, None)
