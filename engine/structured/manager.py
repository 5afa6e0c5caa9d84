"""Per-sequence grammar matchers and the token bitmasks they give each step.

Life of a structured sequence:
1. ``add``: its spec goes to the compiler (cached, on a background thread) and
   the sequence is marked ``awaiting_grammar``: the scheduler passes over it,
   so it waits in the queue while other requests run (a committed remote
   prefill waits in the running set the same way).
2. ``poll`` (every step, before scheduling): once its grammar is compiled it
   gets a fresh matcher, which first replays the tokens the sequence already
   has past its prompt (a committed first token from a prefill node, the last
   ``resume_offset`` prompt tokens of a migrated stream), and joins scheduling.
   A compile that failed, or outlasted ``compile_timeout_s``, fails the
   sequence (the engine ends it with finish_reason "abort" and the error).
3. ``bitmask``: before a step samples, each structured row's allowed tokens
   (one bit per token id) are filled on the host, into a pinned buffer. A
   row verifying a speculative proposal gets one mask per position: the
   matcher walks the proposal, filling each position's mask, and is rolled
   back to where it was (``valid_prefix`` cut the proposal at the first token
   the grammar rejects, so the walk never fails); the tokens the verify keeps
   advance it afterwards through ``accept``, like any sampled token. (A
   matcher keeps its whole history: xgrammar's ``max_rollback_tokens`` is
   left at its default, -1, unlimited.)
4. ``accept``: each sampled token advances the matcher; a token the grammar
   rejects (only possible when another constraint conflicts with it) is
   reported, never raised. ``terminated``: the grammar accepted its end.
5. ``release`` on finish or abort: the matcher is dropped (``num_matchers``
   counts those alive; zero at idle).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from engine.layers.sampler import GrammarBitmask
from engine.sequence import Sequence
from engine.structured.compiler import GrammarCompiler

# Host bitmask buffers in turn: one may still be copying to the device for the
# step in flight while the next step's is filled; a step's copy is done when
# the engine reads it, and at most two steps are unread.
_NUM_HOST_BUFFERS = 2


@dataclass(slots=True)
class _SeqGrammar:
    seq: Sequence
    future: Future
    deadline: float
    matcher: Any = None  # xgrammar's GrammarMatcher, once compiled


class StructuredOutputManager:
    def __init__(
        self,
        compiler: GrammarCompiler,
        vocab_size: int,
        max_rows: int,
        compile_timeout_s: float,
        pin_memory: bool,
    ) -> None:
        self.compiler = compiler
        self.width = (vocab_size + 31) // 32
        self.max_rows = max_rows
        self.compile_timeout_s = compile_timeout_s
        self.pin_memory = pin_memory
        self._seqs: dict[int, _SeqGrammar] = {}  # by seq_id
        self._pending: dict[int, _SeqGrammar] = {}  # still compiling
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    # ----------------------------------------------------------- compiling
    def add(self, seq: Sequence) -> None:
        so = seq.params.structured_outputs
        entry = _SeqGrammar(
            seq, self.compiler.submit(so), time.monotonic() + self.compile_timeout_s
        )
        self._seqs[seq.seq_id] = entry
        self._pending[seq.seq_id] = entry
        seq.awaiting_grammar = True

    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` for a compile to finish (only when the engine
        has nothing else to run)."""
        if self._pending:
            wait([e.future for e in self._pending.values()], timeout, FIRST_COMPLETED)

    def poll(self) -> list[tuple[Sequence, str]]:
        """Start the matchers of compiled grammars; (sequence, error) for each
        whose grammar failed, timed out or rejected its replayed tokens."""
        failed: list[tuple[Sequence, str]] = []
        now = time.monotonic()
        for seq_id, entry in list(self._pending.items()):
            if entry.future.done():
                del self._pending[seq_id]
                error = entry.future.exception()
                if error is None:
                    error = self._start(entry)
                if error is not None:
                    failed.append((entry.seq, str(error)))
            elif now > entry.deadline:
                del self._pending[seq_id]
                kind = entry.seq.params.structured_outputs.kind
                failed.append(
                    (
                        entry.seq,
                        f"structured_outputs.{kind} did not compile within "
                        f"{self.compile_timeout_s:g} s (compile_timeout_s)",
                    )
                )
        return failed

    def _start(self, entry: _SeqGrammar) -> str | None:
        import xgrammar as xgr

        seq = entry.seq
        matcher = xgr.GrammarMatcher(entry.future.result())
        start = seq.num_prompt_tokens - seq.params.resume_offset
        for token in seq.token_ids[start:]:
            if token < 0:
                break  # a placeholder: read later, accepted then
            if not matcher.accept_token(token):
                return f"structured_outputs: the tokens so far break the grammar at token {token}"
        entry.matcher = matcher
        seq.awaiting_grammar = False
        return None

    # ------------------------------------------------------------ matching
    def accept(self, seq: Sequence, token: int) -> str | None:
        """Advance ``seq``'s matcher by ``token``; the error if the grammar rejects
        it. A matcher not started yet replays the token when it starts."""
        entry = self._seqs.get(seq.seq_id)
        if entry is None or entry.matcher is None:
            return None
        if entry.matcher.is_terminated() or not entry.matcher.accept_token(token):
            return (
                f"structured_outputs: token {token} is not allowed by the grammar (another "
                "constraint, such as allowed_token_ids, logit_bias or min_tokens, conflicts with it)"
            )
        return None

    def terminated(self, seq: Sequence) -> bool:
        entry = self._seqs.get(seq.seq_id)
        return entry is not None and entry.matcher is not None and entry.matcher.is_terminated()

    def release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)
        self._pending.pop(seq.seq_id, None)

    @property
    def num_matchers(self) -> int:
        """Sequences holding grammar state (compiling or matching)."""
        return len(self._seqs)

    def valid_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """How many leading ``tokens`` (a speculative proposal) the grammar
        allows after ``seq``'s tokens: none past one that ends the grammar.
        The matcher is left as it was."""
        entry = self._seqs.get(seq.seq_id)
        if entry is None or entry.matcher is None:
            return 0
        matcher = entry.matcher
        num = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            num += 1
        if num:
            matcher.rollback(num)
        return num

    # ------------------------------------------------------------- bitmask
    def bitmask(self, rows: list[Sequence]) -> GrammarBitmask | None:
        """The allowed tokens of each structured row among ``rows`` (the step's
        sampling rows, in sample order), or None when none is structured.
        Masks are indexed by sample row: a row verifying ``k`` proposed tokens
        has ``k + 1`` of them (engine/spec_decode/verify_rows.py)."""
        entries = self._seqs
        which: list[int] = []  # sample rows
        fills: list[tuple[Any, list[int]]] = []  # (matcher, proposal) per structured row
        sample_row = 0
        for seq in rows:
            if seq.seq_id in entries:
                which.extend(range(sample_row, sample_row + 1 + len(seq.spec_token_ids)))
                fills.append((entries[seq.seq_id].matcher, seq.spec_token_ids))
            sample_row += 1 + len(seq.spec_token_ids)
        if not which:
            return None
        buf = self._next_buffer()[: len(which)]
        k = 0
        for matcher, proposal in fills:
            k = _fill_positions(matcher, proposal, buf, k)
        return GrammarBitmask(buf, which)

    def _next_buffer(self) -> torch.Tensor:
        # max_rows counts sample rows: a verifying sequence has several.
        if not self._buffers:
            self._buffers = [
                torch.empty(
                    self.max_rows, self.width, dtype=torch.int32, pin_memory=self.pin_memory
                )
                for _ in range(_NUM_HOST_BUFFERS)
            ]
        self._turn = (self._turn + 1) % _NUM_HOST_BUFFERS
        return self._buffers[self._turn]


def _fill_positions(matcher: Any, proposal: list[int], buf: torch.Tensor, k: int) -> int:
    """Fill ``buf[k:]`` with the masks of a row's positions: its next token,
    then after each proposed token in turn; the matcher ends where it began.
    Returns the next free index. Past the grammar's end, or past a proposed
    token it rejects (its own mask then rejects it, so the verify never keeps
    it), a position's sample is dropped: its mask allows any token."""
    walked = 0
    live = matcher is not None
    for i in range(len(proposal) + 1):
        live = live and not matcher.is_terminated()
        if live:
            matcher.fill_next_token_bitmask(buf, k)
        else:
            buf[k].fill_(-1)
        k += 1
        if live and i < len(proposal):
            live = matcher.accept_token(proposal[i])
            walked += 1 if live else 0
    if walked:
        matcher.rollback(walked)
    return k
