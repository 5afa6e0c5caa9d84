"""Structured outputs' host side without a model: the scheduler passes over a
sequence whose grammar compiles, and the sampler's bitmask application."""

from __future__ import annotations

import torch

from engine.block_manager import BlockManager
from engine.layers.sampler import GrammarBitmask, Sampler, SamplingRow, apply_token_bitmask
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import SequenceStatus
from tests.unit.engine.helpers import make_seq


def _scheduler() -> Scheduler:
    return Scheduler(BlockManager(64, 4, True), 8, 64, 256)


def test_a_compiling_sequence_keeps_its_place_while_others_run():
    sched = _scheduler()
    first, second, third = make_seq(5), make_seq(6), make_seq(7)
    for seq in (first, second, third):
        sched.add(seq)
    second.awaiting_grammar = True
    batch = sched.schedule()
    assert batch.seqs == [first, third]
    assert list(sched.waiting) == [second]
    sched.update(batch, [1] * len(batch.seqs))
    second.awaiting_grammar = False
    batch = sched.schedule()
    assert second in batch.admitted


def test_a_committed_sequence_waits_in_the_running_set_for_its_grammar():
    sched = _scheduler()
    seq, other = make_seq(8), make_seq(8)
    assert sched.reserve(seq)
    seq.token_ids.append(7)  # the prefill node's first token
    sched.commit(seq)
    seq.awaiting_grammar = True
    sched.add(other)
    batch = sched.schedule()
    assert batch.seqs == [other] and seq.status is SequenceStatus.RUNNING
    seq.awaiting_grammar = False
    sched.update(batch, [1])
    assert seq in sched.schedule().seqs


def _bits(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's layout: bit t % 32 of word t // 32, as int32."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_sets_disallowed_logits_to_minus_inf():
    gen = torch.Generator().manual_seed(0)
    vocab = 75  # not a multiple of 32: the last word is partly padding
    allowed = torch.rand(3, vocab, generator=gen) > 0.6
    logits = torch.randn(5, vocab, generator=gen)
    before = logits.clone()
    apply_token_bitmask(logits, GrammarBitmask(_bits(allowed), [0, 2, 4]))
    for k, r in enumerate([0, 2, 4]):
        assert torch.equal(torch.isinf(logits[r]), ~allowed[k])
        assert torch.equal(logits[r][allowed[k]], before[r][allowed[k]])
    assert torch.equal(logits[[1, 3]], before[[1, 3]])


def test_sampler_picks_only_allowed_tokens_and_reports_their_logprobs():
    vocab = 40
    sampler = Sampler(vocab, torch.device("cpu"), seed=0)
    logits = torch.randn(2, vocab)
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [3, 17, 33]] = True
    greedy = SamplingParams(temperature=0, logprobs=2)
    hot = SamplingParams(temperature=1.0, seed=5, logprobs=2)
    rows = [SamplingRow(greedy, [0], 1, None, []), SamplingRow(hot, [0], 1, None, [])]
    for _ in range(20):
        out = sampler(logits.clone(), rows, GrammarBitmask(_bits(allowed.repeat(2, 1)), [0, 1]))
        assert set(out.token_ids) <= {3, 17, 33}
        for lp in out.logprobs:
            assert set(lp.top_ids) <= {3, 17, 33}
    masked = logits.clone()
    masked[:, ~allowed[0]] = float("-inf")
    assert out.token_ids[0] == int(masked[0].argmax())
