"""The garbage collector in a serving process: freeze the start-up heap, time the pauses.

Why: CPython's full (generation 2) collection walks every container object
alive, and a node's heap after start-up is mostly torch, triton, transformers
and the model's modules -- hundreds of thousands of objects that never become
garbage. A full collection of that heap stops every thread of the process
for longer than many steps (docs/lab/2026-11-25-stalls-under-load.md); the
engine thread cannot launch a step and the gRPC loop cannot
stream a token meanwhile. Under load such collections come every few seconds,
because requests' objects live long enough to be promoted, so they land on
first tokens as a random extra delay: the bimodal TTFT at saturation.

``freeze_heap`` collects once and moves everything alive into the permanent
generation (``gc.freeze``), which later collections skip: a full collection
then walks only what the process allocated since (live requests), a few
milliseconds. Objects frozen are never collected, which costs nothing for a
heap that lives as long as the process. vLLM's engine process does the same
after start-up.

``GcPauses`` times every collection through ``gc.callbacks`` (a few
microseconds each), for the metrics and for a warning when one is long;
servers install it once serving, after the freeze.
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
from dataclasses import dataclass, field

from common.metrics.histogram import Histogram
from common.runtime.env_switch import env_switch

logger = logging.getLogger(__name__)

# A full collection of a frozen heap takes milliseconds; of an unfrozen one, hundreds.
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A pause this long is worth a line in the log: it delays every stream of the process.
WARN_PAUSE_S = 0.05


def add_gc_arguments(p: argparse.ArgumentParser) -> None:
    """The router's and the nodes' switch for ``freeze_heap``."""
    p.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=env_switch("PDSERVE_GC_FREEZE") is not False,
        help="once serving, freeze the start-up heap out of the garbage collector's reach, so "
        "full collections stop walking it and pausing the process (default on) "
        "[PDSERVE_GC_FREEZE=1|0]",
    )


def freeze_heap(what: str) -> int:
    """Collect once, then freeze every object alive (call when start-up is done).

    Returns how many objects are frozen in all (earlier freezes included)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: froze %d start-up objects out of the garbage collector's reach (%.0f ms)",
        what,
        frozen,
        (time.perf_counter() - started) * 1e3,
    )
    return frozen


@dataclass(slots=True)
class GcPauses:
    """Counts and times this process's collections, per generation, from install on."""

    warn_s: float = WARN_PAUSE_S
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    # Full collections only: the ones that can stall a stream.
    full_pauses: Histogram = field(default_factory=lambda: Histogram(GC_PAUSE_BUCKETS))
    longest_s: float = 0.0  # of any generation
    _started: float = 0.0
    _installed: bool = False

    def install(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict) -> None:
        # Collections do not nest (the collector runs one at a time under the
        # GIL), so one start stamp is enough.
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += pause
        self.longest_s = max(self.longest_s, pause)
        if generation == 2:
            self.full_pauses.observe(pause)
        if pause >= self.warn_s:
            logger.warning(
                "garbage collection (generation %d) paused this process for %.0f ms "
                "(%d objects collected, %d frozen): every stream waited",
                generation,
                pause * 1e3,
                info.get("collected", 0),
                gc.get_freeze_count(),
            )
