"""A launched model step whose results the host has not read yet (async scheduling).

With async scheduling the engine launches step N+1 before it reads step N's
sampled tokens, so the host's scheduling, input building and output processing
overlap the GPU's work instead of running while it waits:

    launch N+1 (its inputs take step N's samples straight from the device)
    -> wait for step N's samples, apply stop conditions, build outputs
    -> advance N+1 (count its tokens computed, give its samplers a placeholder)

Between ``Scheduler.advance`` and this step's ``wait`` a sequence that sampled
ends with ``PLACEHOLDER``: its length is right (the scheduler plans the next
decode from it) but its value is only on the device. Only one step's
placeholders exist at a time, and they are filled before anything reads
them (stop checks, outputs, block hashes).

A sequence that finishes on step N's token may already be in step N+1: that
step's token for it is dropped (``advance`` skips finished sequences, so it
is never appended, counted or emitted), and its KV write lands in blocks the
finish already freed, which is harmless: any later step that reuses them runs
after it on the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.layers.sampler import DeviceSamples
from engine.model_io import ModelInputs, PromptTokenLogprob, StepOutput
from engine.scheduler import ScheduledBatch
from engine.sequence import PLACEHOLDER

__all__ = ["PLACEHOLDER", "InFlightStep", "patch_inputs"]


@dataclass(slots=True)
class InFlightStep:
    batch: ScheduledBatch
    sampling: list[int]  # batch rows that sample, in sample order
    samples: DeviceSamples | None
    prompt_logprobs: list[list[PromptTokenLogprob] | None]
    # The sampled ids on the device: the next step's inputs read them from here.
    sampled_device: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    # seq_id -> (sample index, position in token_ids) of its placeholder.
    placeholders: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        batch: ScheduledBatch,
        sampling: list[int],
        samples: DeviceSamples | None,
        prompt_logprobs: list[list[PromptTokenLogprob] | None],
        non_blocking: bool,
    ) -> InFlightStep:
        step = cls(batch, sampling, samples, prompt_logprobs)
        if samples is not None:
            step.sampled_device = samples.token_ids
            samples.copy_to_host(non_blocking)
            if non_blocking and step.sampled_device.device.type == "cuda":
                step.event = torch.cuda.Event()
                step.event.record()
        return step

    def wait(self) -> StepOutput:
        """The step's results as host data (blocks until the device produced them)."""
        if self.event is not None:
            self.event.synchronize()
        num = len(self.batch.seqs)
        sampled: list[int | None] = [None] * num
        logprobs: list = [None] * num
        if self.samples is not None:
            host = self.samples.to_host()
            for j, i in enumerate(self.sampling):
                sampled[i] = host.token_ids[j]
                logprobs[i] = host.logprobs[j]
        self.sampled_device = None  # the next step has read it (stream order)
        return StepOutput(sampled, logprobs, self.prompt_logprobs)


def patch_inputs(
    inputs: ModelInputs, batch: ScheduledBatch, starts: list[int], prev: InFlightStep
) -> None:
    """Write ``prev``'s device-side samples into this step's input ids where the
    host only has placeholders (a device gather: no host round trip)."""
    if not prev.placeholders or prev.sampled_device is None:
        return
    qsl = inputs.meta.query_start_loc_cpu
    dest: list[int] = []
    src: list[int] = []
    for i, (seq, start, n) in enumerate(zip(batch.seqs, starts, batch.num_new_tokens, strict=True)):
        hit = prev.placeholders.get(seq.seq_id)
        if hit is not None and start <= hit[1] < start + n:
            dest.append(qsl[i] + hit[1] - start)
            src.append(hit[0])
    if not dest:
        return
    dev = inputs.input_ids.device
    dest_t = _index(dest, dev)
    src_t = _index(src, dev)
    inputs.input_ids[dest_t] = prev.sampled_device[src_t]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
