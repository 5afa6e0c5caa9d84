"""Where a prompt's time went on the node that computed it: queued, then prefilled.

vLLM exports the same two phases (``vllm:request_queue_time_seconds``,
``vllm:request_prefill_time_seconds``), and the split is what tells a slow
first token apart: a long queue means the node is short of prefill capacity (or
routed too much to it), a long prefill means the steps that ran the prompt were
slow or shared with much other work. The router's TTFT cannot tell the two
apart, and neither can a load generator that sees only the stream.

- queue: the engine received the request -> it was first admitted into a batch;
- prefill: first admitted -> its first token was sampled (every chunk of a
  chunked prompt, and the steps it shared with others).

Observed once per prompt computed here: on a prefill node for every Prefill
call, on a decode node for the requests it prefills itself (a remote prefill's
phases are the prefill node's). Plain data, read at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.metrics.histogram import TTFT_BUCKETS, Histogram
from engine.outputs import RequestMetrics


@dataclass(slots=True)
class PromptPhases:
    """One prompt's two phases, seconds."""

    queue_s: float
    prefill_s: float

    @classmethod
    def of(cls, m: RequestMetrics) -> PromptPhases | None:
        """From the engine's stamps; None until the first token was sampled. A
        request the engine never stamped as scheduled (committed with its KV
        already computed) had no queue of its own here."""
        if m.first_token_time is None:
            return None
        scheduled = m.first_scheduled_time or m.arrival_time
        return cls(max(0.0, scheduled - m.arrival_time), max(0.0, m.first_token_time - scheduled))


def phase_spans(m: RequestMetrics) -> list[tuple[str, float, float]]:
    """The two phases as (name, start, end) times (time.monotonic()), for a
    request's span (common/tracing.py); none until the first token was sampled."""
    if m.first_token_time is None:
        return []
    scheduled = m.first_scheduled_time or m.arrival_time
    return [("queue", m.arrival_time, scheduled), ("compute", scheduled, m.first_token_time)]


@dataclass(slots=True)
class PhaseHistograms:
    queue_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    prefill_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))

    def observe(self, phases: PromptPhases) -> None:
        self.queue_s.observe(phases.queue_s)
        self.prefill_s.observe(phases.prefill_s)

    def histograms(self) -> dict[str, Histogram]:
        """By ``common.metrics.node.HISTOGRAMS`` key."""
        return {"request_queue_seconds": self.queue_s, "request_prefill_seconds": self.prefill_s}
