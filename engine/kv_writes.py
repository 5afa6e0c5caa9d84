"""The engine-level hook a prefill node streams its KV from, layer by layer.

It names no transfer and imports nothing of the service: an observer is told,
on the engine thread, which sequences a step is about to compute, and then when
each layer's KV of that step is written.

``KVWriteObserver.begin_step(batch)`` runs when a step is about to be launched
(its blocks are allocated, each sequence's ``num_computed_tokens`` is still the
step's start, ``batch.num_new_tokens`` its count). It returns None when nothing
in the step interests it -- the step then runs as usual, CUDA graphs included --
or a ``LayerDone`` callback: the step then replays no whole-model CUDA graph
(it runs eagerly, or on piecewise graphs, engine/piecewise_graphs.py, which call
it between their pieces) and ``layer_done(i)`` is called right after layer i
was issued. On a CPU layer i has been
computed by then; on a GPU its kernels are queued on the current stream, so
whatever the callback queues on that stream (a gather, an event) is ordered
after layer i's KV writes and before layer i + 1's attention (on piecewise
graphs the piece before it also ran layer i + 1's projection and KV store).

``step_sampled(samples, rows)`` follows on a step it asked layers of and
whose sequences sample: the step's ``DeviceSamples`` (engine/layers/sampler.py:
``samples.token_ids[j]`` is batch row ``rows[j]``'s sample, and the logprobs of
the rows that asked for them), queued on the current stream and not yet on the
host; whatever it queues behind them is ordered after the sampling (a prefill
node sends a prompt's first token that way, without waiting for the host).

With tensor parallelism rank 0's observer sees the batch; an observer on
another rank is asked with ``batch=None`` (it learnt what the step holds from
rank 0's ``call_workers`` before it), and the step runs eagerly on every rank
whenever rank 0's observer asked for layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.layers.sampler import DeviceSamples
    from engine.scheduler import ScheduledBatch

LayerDone = Callable[[int], None]


class KVWriteObserver(Protocol):
    def begin_step(self, batch: ScheduledBatch | None) -> LayerDone | None: ...

    def step_sampled(self, samples: DeviceSamples, rows: list[int]) -> None: ...
