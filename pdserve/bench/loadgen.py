"""The open-loop load generator: requests leave on a schedule, whatever the server does.

Inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean
1 / rate (burstiness 1 is a Poisson process; lower is burstier, higher more
regular), as in ``vllm bench serve``; rate inf sends everything at once.
``max_concurrency`` caps requests in flight: a request whose time has come
waits for a slot (so the run is no longer open-loop past that point).
Multi-turn: conversations start on the schedule; each sends its next turn
when the previous reply is complete.

The generator's own garbage collector is kept off the clock: a full collection
walks every container alive (the datasets' prompts, the imports, the earlier
rates' results) and stops the process meanwhile, so requests leave late and
tokens are stamped late: one rate of a sweep showed a send lag
(``send_lag_max_ms``) many times the others', for pdserve and vLLM alike
(docs/lab/2026-11-27-pdserve-bench-serve.md). So each rate starts by collecting
once and freezing what is alive (``gc.freeze``: later collections skip it, and
walk only what the rate allocates), and ends by unfreezing; the record says how
many full collections ran during the rate and the longest pause of any. The
freeze is the process's: the unfreeze also undoes any freeze a caller made
before (the bench CLI makes none).
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from common.runtime.gc_heap import GcPauses
from pdserve.bench.backends import Backend, RequestResult
from pdserve.bench.datasets import BenchRequest, Dataset


def arrival_gaps(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Seconds between consecutive sends."""
    if burstiness <= 0:
        raise ValueError("--burstiness must be positive")
    rng = random.Random(seed)
    while True:
        if math.isinf(rate):
            yield 0.0
        else:
            # Gamma with mean 1/rate: shape k = burstiness, scale 1 / (rate * k).
            yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


@dataclass(slots=True)
class RunResult:
    results: list[RequestResult]
    duration_s: float
    # How late requests left against their schedule (no concurrency cap only):
    # the generator's own limit shows here before it shows in the figures.
    send_lag_mean_ms: float
    send_lag_max_ms: float
    # The generator's own garbage collections during the rate (module docstring).
    gc_full_collections: int = 0
    gc_longest_pause_ms: float = 0.0


class _Conversations:
    """Sends a rate's requests and follows their conversations (multi-turn:
    each turn after the first goes once the reply before it came)."""

    def __init__(self, backend: Backend, dataset: Dataset, sem, on_done) -> None:
        self.backend = backend
        self.workload = dataset.multi_turn
        self.sem = sem
        self.on_done = on_done
        self.results: list[RequestResult] = []
        self.lags: list[float] = []  # how late each scheduled send left, s

    async def one(self, req: BenchRequest, due: float | None) -> RequestResult:
        if self.sem is not None:
            async with self.sem:
                r = await self.backend.send(req)
        else:
            r = await self.backend.send(req)
        if due is not None:
            self.lags.append(r.start_s - due)
        self.results.append(r)
        if self.on_done is not None:
            self.on_done(r)
        return r

    async def conversation(self, first: BenchRequest, due: float | None) -> None:
        req: BenchRequest | None = first
        while req is not None:
            r = await self.one(req, due)
            due = None  # only a conversation's first turn has a schedule
            if not r.success or self.workload is None:
                return
            if not r.output_ids:
                # A failure, counted: the next turn needs the reply's token ids.
                r.success = False
                r.error = "multi-turn needs the reply's token ids (server gave none)"
                return
            req = self.workload.next_turn(req, r.output_ids)


async def run_rate(
    backend: Backend,
    dataset: Dataset,
    rate: float,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> RunResult:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    sent = _Conversations(backend, dataset, sem, on_done)
    tasks = []
    gaps = arrival_gaps(rate, burstiness, seed)
    gc.unfreeze()  # an earlier rate's frozen results are garbage now: freed here, off the clock
    gc.collect()
    gc.freeze()
    pauses = GcPauses().install()
    try:
        start = time.perf_counter()
        due = start
        for req in dataset.requests:
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(sent.conversation(req, due if sem is None else None)))
            due += next(gaps)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    finally:
        pauses.uninstall()
        gc.unfreeze()
    lags = sent.lags
    return RunResult(
        results=sent.results,
        duration_s=duration,
        send_lag_mean_ms=1e3 * sum(lags) / len(lags) if lags else 0.0,
        send_lag_max_ms=1e3 * max(lags, default=0.0),
        gc_full_collections=pauses.collections[2],
        gc_longest_pause_ms=1e3 * pauses.longest_s,
    )


async def warm_up(backend: Backend, requests: list[BenchRequest]) -> list[RequestResult]:
    """Send ``requests`` all at once and wait; their results are not counted."""
    return list(await asyncio.gather(*(backend.send(r) for r in requests)))
