"""Structured outputs inside the engine's step: what ``LLMEngine`` asks of them.

How a step's bitmask meets async scheduling. Step N+1 is launched before the
host reads step N's samples, but a structured row's mask for N+1 depends on
the token N sampled for it. So a step with such a row (its last token still a
placeholder) is launched in two halves, as vLLM v1 defers ``sample_tokens``:
its forward is enqueued first (the device runs it, after N), then the host
reads N, advances the grammars by N's tokens and fills N+1's bitmasks, then
N+1's sampling is enqueued with them. The forward overlaps the host's work;
only the sampling waits for it. A step with no such row is launched whole,
its masks filled before the launch (no placeholder: the matchers are current).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.sequence import Request, Sequence
from engine.structured.compiler import GrammarStats

if TYPE_CHECKING:
    from engine.async_step import InFlightStep
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.outputs import RequestOutput
    from engine.scheduler import ScheduledBatch
    from engine.structured.manager import StructuredOutputManager

# With nothing else to run, the engine waits this long for a compile to end
# before its step returns (so a caller's loop never spins on one).
IDLE_WAIT_S = 0.002


class StructuredOutputs:
    """The engine's structured-output state; the manager (and xgrammar) come
    with the first structured request."""

    def __init__(
        self, config: EngineConfig, tokenizer: Any, eos_token_ids: frozenset[int], pin: bool
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.pin = pin
        self.manager: StructuredOutputManager | None = None

    def _manager(self) -> StructuredOutputManager:
        if self.manager is None:
            from engine.structured.compiler import GrammarCompiler
            from engine.structured.manager import StructuredOutputManager

            so = self.config.structured_outputs_config
            vocab = self.config.model_config.vocab_size
            # Grammars compiled for one tokenizer serve no other: it keys the cache.
            key = f"{os.path.realpath(self.config.tokenizer)}:{vocab}"
            compiler = GrammarCompiler(
                self.tokenizer,
                key,
                vocab,
                self.eos_token_ids,
                so.grammar_cache_size,
                so.compile_workers,
            )
            # A verifying sequence samples (and masks) one row per position.
            spec = self.config.speculative_config
            rows_per_seq = 1 + (spec.num_speculative_tokens if spec is not None else 0)
            self.manager = StructuredOutputManager(
                compiler,
                vocab,
                self.config.max_num_seqs * rows_per_seq,
                so.compile_timeout_s,
                self.pin,
            )
        return self.manager

    def warm_up(self) -> None:
        """A node that serves structured outputs calls this at start: xgrammar's
        import and the tokenizer's index, not small, happen in the background
        then, not in the first such request's wait."""
        if self.tokenizer is not None:
            self._manager().compiler.warm_up()

    # ------------------------------------------------------------ requests
    def add(self, req: Request) -> None:
        """Start compiling a new request's grammar (its sequences wait for it)."""
        if req.params.structured_outputs is None:
            return
        so = req.params.structured_outputs
        if self.config.structured_outputs_config.disable_any_whitespace and so.kind in (
            "json",
            "json_object",
        ):
            req.params.structured_outputs = dataclasses.replace(so, disable_any_whitespace=True)
        manager = self._manager()
        for seq in req.seqs:
            manager.add(seq)

    def accept(self, seq: Sequence, token: int) -> str | None:
        return self.manager.accept(seq, token) if self.manager is not None else None

    def valid_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """How many leading proposed ``tokens`` ``seq``'s grammar allows."""
        return self.manager.valid_prefix(seq, tokens) if self.manager is not None else 0

    def terminated(self, seq: Sequence) -> bool:
        return self.manager is not None and self.manager.terminated(seq)

    def release(self, seq: Sequence) -> None:
        if self.manager is not None and seq.params.structured_outputs is not None:
            self.manager.release(seq)

    @property
    def num_matchers(self) -> int:
        return self.manager.num_matchers if self.manager is not None else 0

    def stats(self) -> GrammarStats:
        """Compiles, cache hits and misses, and matchers alive (zeros before the
        first structured request)."""
        if self.manager is None:
            return GrammarStats()
        return self.manager.compiler.stats(self.manager.num_matchers)

    def poll(self) -> list[tuple[Sequence, str]]:
        """Sequences whose grammar failed (compile error or timeout), with why."""
        if self.manager is None or not self.manager.has_pending():
            return []
        return self.manager.poll()

    def idle_wait(self) -> bool:
        """When a step found nothing to run: wait briefly for a compile; False if
        none is running (then the emptiness has another cause)."""
        if self.manager is None or not self.manager.has_pending():
            return False
        self.manager.wait(IDLE_WAIT_S)
        return True

    # ----------------------------------------------------------------- step
    def launch(
        self,
        runner: ModelRunner,
        batch: ScheduledBatch,
        prev: InFlightStep | None,
        non_blocking: bool,
        finish_prev: Callable[[InFlightStep], list[RequestOutput]],
    ) -> tuple[InFlightStep, list[RequestOutput] | None]:
        """Launch ``batch``; the outputs of ``prev`` when it had to be read first
        (then the caller must not read it again), else None."""
        manager = self.manager
        if manager is None or not manager.num_matchers:
            return runner.launch(batch, prev, non_blocking), None
        sampling = batch.sampling_rows()
        rows = [batch.seqs[i] for i in sampling]
        pending = prev is not None and any(
            s.pending_sample >= 0 and s.params.structured_outputs is not None for s in rows
        )
        if not pending:
            return runner.launch(batch, prev, non_blocking, manager.bitmask(rows)), None
        forwarded = runner.forward_step(batch, prev, non_blocking)
        outputs = finish_prev(prev)  # advances the grammars by prev's tokens
        return runner.sample_step(forwarded, manager.bitmask(rows)), outputs
