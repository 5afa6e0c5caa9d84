"""What a node exports about its engine's steps: their size, and the device's
wait for each step's host work.

- Tokens per step (``pdserve_engine_step_tokens``; vLLM's
  ``vllm:iteration_tokens_total``): how coarsely the scheduler batches. At one
  load, fewer and larger steps mean each decode row waits through more prompt
  tokens per step.
- Idle before a step (``pdserve_engine_idle_before_step_seconds{step}``). With
  async scheduling the host builds and launches step N+1 while the device runs
  step N; when the host is late (a slow schedule, a long input build, an eager
  launch of a few hundred kernels, the GIL held elsewhere) the device sits idle
  between the two. The engine measures the gap with CUDA events for every step
  queued behind another (``InFlightStep.idle_seconds``: from N's end to N+1's
  first work); CPU engines and steps queued behind nothing (the first after an
  idle spell, a step that waited for the last one's tokens) are not measured.
  By step kind: ``prompt`` (with prompt rows) and ``decode`` (decodes only).

The engine logs every step it reads (``LLMEngine.step_log``); the node drains
the log on the engine thread after every step. ``pdserve bench serve
--scrape-metrics`` records both per rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.metrics.histogram import STEP_IDLE_BUCKETS, STEP_TOKEN_BUCKETS, Histogram
from engine.async_step import StepLog


@dataclass(slots=True)
class StepHistograms:
    tokens: Histogram = field(default_factory=lambda: Histogram(STEP_TOKEN_BUCKETS))
    idle_prompt: Histogram = field(default_factory=lambda: Histogram(STEP_IDLE_BUCKETS))
    idle_decode: Histogram = field(default_factory=lambda: Histogram(STEP_IDLE_BUCKETS))

    def drain(self, log: StepLog) -> None:
        """Observe what ``log`` holds (on the engine thread, which owns it)."""
        records = log.take()
        if not records:
            return
        self.tokens.observe_many(r.num_tokens for r in records)
        for hist, prompt_rows in ((self.idle_prompt, True), (self.idle_decode, False)):
            idle = [
                r.idle_s
                for r in records
                if r.has_prompt_rows is prompt_rows and r.idle_s is not None
            ]
            if idle:
                hist.observe_many(idle)

    def idle_by_step_kind(self) -> dict[str, Histogram]:
        """By the ``step`` label's value."""
        return {"prompt": self.idle_prompt, "decode": self.idle_decode}
