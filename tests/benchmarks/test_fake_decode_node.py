"""The router benchmarks' fake decode node: its token ticks keep their cadence."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

from benchmarks.fake_decode_node import TokenTicks


def test_token_ticks_keep_a_fixed_cadence_when_waiters_come_late():
    """Tick k is due at the first tick + k intervals, however late its waiters
    call: each of two streams works (blocking the loop) 5 ms after every tick;
    a clock whose next tick its first waiter scheduled ran a 25 ms period here
    (23.7 ms with 3 ms of work), this one runs 20."""
    interval = 0.02
    ticks = TokenTicks(interval)
    seen: list[float] = []

    async def stream(i: int) -> None:
        for _ in range(12):
            await ticks.tick()
            if i == 0:
                seen.append(time.monotonic())
            time.sleep(0.005)  # each of two streams: 5 ms of the loop per token

    async def main() -> None:
        await asyncio.gather(stream(0), stream(1))

    asyncio.run(main())
    periods = [b - a for a, b in itertools.pairwise(seen)]
    assert interval * 0.9 < statistics.mean(periods) < interval * 1.1, periods
    # Every waiter of a tick leaves in the same tick: none is a tick behind.
    assert len(seen) == 12
