"""The device's wait for each engine step's host work, as a node exports it.

With async scheduling the host builds and launches step N+1 while the device
runs step N; when the host is late (a slow schedule, a long input build, an
eager launch of a few hundred kernels, the GIL held elsewhere) the device sits
idle between the two. The engine measures that gap with CUDA events for every
step queued behind another (``InFlightStep.idle_seconds``: from N's end to
N+1's first work) and logs it (``LLMEngine.idle_log``); the node drains the log
on the engine thread after every step into two histograms, steps with prompt
rows and decode-only steps, exported as
``pdserve_engine_idle_before_step_seconds{step="prompt"|"decode"}``. Their
sums over a window against its length are the device time lost to the host;
``pdserve bench serve --scrape-metrics`` records them per rate. CPU engines and
steps not queued behind another (the first after an idle spell, a step that
waited for the last one's tokens) are not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.metrics.histogram import STEP_IDLE_BUCKETS, Histogram
from engine.async_step import IdleLog


@dataclass(slots=True)
class StepIdleHistograms:
    prompt: Histogram = field(default_factory=lambda: Histogram(STEP_IDLE_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(STEP_IDLE_BUCKETS))

    def drain(self, log: IdleLog) -> None:
        """Observe what ``log`` holds (on the engine thread, which owns it)."""
        entries = log.take()
        if not entries:
            return
        prompt = [s for has_prompt_rows, s in entries if has_prompt_rows]
        decode = [s for has_prompt_rows, s in entries if not has_prompt_rows]
        if prompt:
            self.prompt.observe_many(prompt)
        if decode:
            self.decode.observe_many(decode)

    def by_step_kind(self) -> dict[str, Histogram]:
        """By the ``step`` label's value."""
        return {"prompt": self.prompt, "decode": self.decode}
