"""Which asyncio event loop a server process runs: uvloop when it is installed, else asyncio's.

Why: the router's one event loop carries every stream's messages (gRPC in and
out, the OpenAI edge's Server-Sent Events), and under load a first token waits
behind other streams' callbacks. uvloop's loop (libuv, Cython) runs the same
callbacks, timers and sockets for less CPU than asyncio's pure-Python one;
docs/lab/2026-11-25-router-event-loop-sse.md has the figures. grpc.aio, uvicorn and redis-py run on
either unchanged.

It is a choice, not a requirement: ``--event-loop asyncio`` (or
PDSERVE_EVENT_LOOP=asyncio) falls back to the standard loop, and a machine
without uvloop (it has no Windows build) gets the standard loop with a log line
saying so. Every process logs which loop it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

AUTO, UVLOOP, ASYNCIO = "auto", "uvloop", "asyncio"
CHOICES = (AUTO, UVLOOP, ASYNCIO)
ENV = "PDSERVE_EVENT_LOOP"

T = TypeVar("T")


def add_event_loop_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--event-loop",
        choices=CHOICES,
        default=os.environ.get(ENV, AUTO),
        help="asyncio event loop: uvloop where installed (auto, the default), uvloop "
        f"(fail without it) or asyncio's own [{ENV}]",
    )


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """(the factory for asyncio.Runner, None for asyncio's default; the loop's name).
    Raises ValueError for ``uvloop`` where it is not installed, or an unknown choice."""
    if choice not in CHOICES:
        raise ValueError(f"--event-loop must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == ASYNCIO:
        return None, ASYNCIO
    try:
        import uvloop
    except ImportError:
        if choice == UVLOOP:
            raise ValueError("--event-loop uvloop: uvloop is not installed") from None
        return None, f"{ASYNCIO} (uvloop not installed)"
    return uvloop.new_event_loop, f"{UVLOOP} {uvloop.__version__}"


def run(main: Callable[[], Awaitable[T]], choice: str = AUTO) -> T:
    """``asyncio.run(main())`` on the chosen loop, saying which one runs."""
    factory, name = loop_factory(choice)
    logger.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())
