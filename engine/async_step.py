"""A launched model step whose results the host has not read yet (async scheduling).

With async scheduling the engine launches step N+1 before it reads step N's
sampled tokens, so the host's scheduling, input building and output processing
overlap the GPU's work instead of running while it waits:

    launch N+1 (its inputs take step N's samples straight from the device)
    -> wait for step N's samples, apply stop conditions, build outputs
    -> advance N+1 (count its tokens computed, give its samplers a placeholder)

Between ``Scheduler.advance`` and this step's ``read`` a sequence that sampled
ends with ``PLACEHOLDER``: its length is right (the scheduler plans the next
decode from it) but its value is only on the device, at the sample index the
sequence keeps in ``pending_sample`` (``patch_indices`` finds them there for
the next step's inputs). Only one step's placeholders exist at a time, and
they are filled before anything reads them (stop checks, outputs, block
hashes).

A sequence that finishes on step N's token may already be in step N+1: that
step's token for it is dropped (``advance`` skips finished sequences, so it
is never appended, counted or emitted), and its KV write lands in blocks the
finish already freed, which is harmless: any later step that reuses them runs
after it on the same stream.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from engine.layers.sampler import DeviceSamples, SamplerOutput
from engine.model_io import PromptTokenLogprob, StepOutput
from engine.scheduler import ScheduledBatch
from engine.sequence import PLACEHOLDER, Sequence
from engine.spec_decode.verify_rows import VerifyLayout
from engine.step_inputs import HostInputs

__all__ = ["PLACEHOLDER", "ForwardedStep", "InFlightStep", "StepLog", "StepRecord", "patch_indices"]


@dataclass(slots=True)
class ForwardedStep:
    """A step whose forward (and sampled rows' logits) is enqueued on the device
    but whose sampling is not (``ModelRunner.forward_step``). Structured outputs
    under async scheduling stop here while the host reads the step before and
    fills the grammar bitmasks from its tokens."""

    batch: ScheduledBatch
    sampling: list[int]  # batch rows that sample, in sample order
    logits: torch.Tensor | None  # [len(sampling), vocab], on the device
    prompt_logprobs: list[list[PromptTokenLogprob] | None] | None
    non_blocking: bool
    began: torch.cuda.Event | None
    prev: InFlightStep | None
    observed: bool  # a KV-write observer saw the step (it is told of the samples)
    # Speculating rows sample several positions each (None: one sample per row).
    verify: VerifyLayout | None = None


@dataclass(slots=True)
class InFlightStep:
    batch: ScheduledBatch
    sampling: list[int]  # batch rows that sample, in sample order
    samples: DeviceSamples | None
    # Per batch row, or None when no row of the step has prompt logprobs.
    prompt_logprobs: list[list[PromptTokenLogprob] | None] | None
    # The sampled ids on the device: the next step's inputs read them from here.
    sampled_device: torch.Tensor | None = None
    # Recorded on the device's stream before the step's first work and after
    # its last (timing events: StepClock learns device times from them).
    began: torch.cuda.Event | None = None
    event: torch.cuda.Event | None = None
    # The end event of the step this one was queued behind (timed steps only):
    # from it to ``began`` the device waited for this step's host work.
    after: torch.cuda.Event | None = None
    # (sequence, sample index, position in token_ids) of each placeholder.
    placeholders: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # A verify step: where each sampled row's samples start (engine/spec_decode/).
    verify: VerifyLayout | None = None

    @classmethod
    def start(
        cls,
        batch: ScheduledBatch,
        sampling: list[int],
        samples: DeviceSamples | None,
        prompt_logprobs: list[list[PromptTokenLogprob] | None] | None,
        non_blocking: bool,
        began: torch.cuda.Event | None = None,
        behind: InFlightStep | None = None,
    ) -> InFlightStep:
        """``behind``: the step in flight this one was queued after (its end event
        is where this one's idle wait starts)."""
        step = cls(batch, sampling, samples, prompt_logprobs)
        if samples is not None:
            step.sampled_device = samples.token_ids
            samples.copy_to_host(non_blocking)
            if non_blocking and step.sampled_device.device.type == "cuda":
                step.began = began
                if began is not None and behind is not None:
                    step.after = behind.event
                step.event = torch.cuda.Event(enable_timing=began is not None)
                step.event.record()
        return step

    @staticmethod
    def mark_begin(device: torch.device, non_blocking: bool) -> torch.cuda.Event | None:
        """A timing event at the stream's current end, for a step about to be
        built (async scheduling on CUDA only; elsewhere there is nothing to time)."""
        if not non_blocking or device.type != "cuda":
            return None
        began = torch.cuda.Event(enable_timing=True)
        began.record()
        return began

    def done(self) -> bool:
        """Whether the device has finished the step (True where nothing can tell)."""
        return self.event is None or self.event.query()

    def device_seconds(self) -> float | None:
        """The step's time on the device, from before its first work to after
        its last (queued behind an earlier step: from that one's end); None
        where it was not timed. Only after ``read``."""
        if self.began is None or self.event is None:
            return None
        return self.began.elapsed_time(self.event) / 1e3

    def idle_seconds(self) -> float | None:
        """How long the device sat idle between the end of the step this one was
        queued behind and this step's first work: the host was late with it (its
        scheduling, input building or launch took longer than the step before
        ran). None where not timed or not queued behind a step. Only after ``read``."""
        if self.after is None or self.began is None:
            return None
        return max(0.0, self.after.elapsed_time(self.began) / 1e3)

    def add_placeholders(self, appended: list[tuple[int, Sequence]]) -> None:
        """Record where ``Scheduler.advance`` put this step's placeholders; each
        sequence remembers its sample index until the step is read."""
        sampling = self.sampling
        every_row = len(sampling) == len(self.batch.seqs)
        j = 0
        for row, seq in appended:
            if every_row:
                j = row  # sample index == batch row
            else:
                while sampling[j] != row:  # both in batch order
                    j += 1
            sample = self.verify.first[j] if self.verify is not None else j
            seq.pending_sample = sample
            self.placeholders.append((seq, sample, len(seq.token_ids) - 1))

    def read(self) -> SamplerOutput | None:
        """The samples as host data, by sample index (blocks until the device
        produced them). Clears the sequences' pending marks."""
        if self.event is not None:
            self.event.synchronize()
        for seq, _, _ in self.placeholders:
            seq.pending_sample = -1
        self.sampled_device = None  # the next step has read it (stream order)
        return self.samples.to_host() if self.samples is not None else None

    def wait(self) -> StepOutput:
        """The step's results as host data aligned with the batch's rows."""
        num = len(self.batch.seqs)
        sampled: list[int | None] = [None] * num
        logprobs: list = [None] * num
        host = self.read()
        if host is not None:
            first = self.verify.first if self.verify is not None else range(len(self.sampling))
            for j, i in zip(first, self.sampling, strict=True):
                sampled[i] = host.token_ids[j]  # a speculating row's first position
                logprobs[i] = host.logprobs[j]
        prompt_logprobs = self.prompt_logprobs or [None] * num
        return StepOutput(sampled, logprobs, prompt_logprobs)


class StepRecord(NamedTuple):
    """One step as read: its tokens, whether it had prompt rows, and the device's
    idle seconds before it (None where not measured: CPU, or not queued behind
    a step)."""

    num_tokens: int
    has_prompt_rows: bool
    idle_s: float | None


@dataclass(slots=True)
class StepLog:
    """Every step the engine read, in order. A node drains it after every step
    into its histograms (common/metrics/steps.py). Bounded, so an engine nobody
    drains (``LLM.generate``) keeps only the latest."""

    entries: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=4096))

    def observe(self, step: InFlightStep) -> None:
        batch = step.batch
        tokens, rows = batch.num_tokens, len(batch.seqs)
        self.entries.append(StepRecord(tokens, tokens > rows, step.idle_seconds()))

    def take(self) -> list[StepRecord]:
        taken = list(self.entries)
        self.entries.clear()
        return taken


def patch_indices(
    host: HostInputs, seqs: list[Sequence], prev: InFlightStep | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """Where this step's input ids need ``prev``'s device-side samples: (token
    index in the step, sample index in ``prev``), or None when nowhere.

    A sequence with an unread sample decodes (its placeholder is its last
    token, the one this step computes), so the sample goes to its chunk's last
    token; the device gathers it without a host round trip.
    """
    if prev is None or not prev.placeholders or prev.sampled_device is None:
        return None
    src = np.fromiter((s.pending_sample for s in seqs), np.int64, len(seqs))
    rows = np.flatnonzero(src >= 0)
    if rows.size == 0:
        return None
    return host.query_start_loc[rows + 1] - 1, src[rows]
