"""Reliability bookkeeping both node kinds share: admission bounds, where a
request was when it was aborted, and the fault-injection delays of tests/faults.

Why count aborts per stage: the classic disaggregation bugs (blocks freed on one
side and still read on the other, reservations leaked forever) live at the
hand-offs between stages, so the fault suite cancels requests at each stage and
checks, through these counters, that it really hit that stage and that every
block came back.
"""

from __future__ import annotations

import enum
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

FAULT_DELAYS_ENV = "PDSERVE_FAULT_DELAYS"
# Node ids that crash at start-up, every time (tests/faults: supervision of a
# component that never comes up, through `pdserve up` itself).
CRASH_AT_START_ENV = "PDSERVE_FAULT_CRASH_AT_START"
# Trailing metadata of a request's failure that names the node at fault (a
# prefill node), so that the router retries elsewhere and avoids it.
FAILED_NODE_KEY = "pdserve-failed-node"


class NoCapacity(RuntimeError):
    """Too few free KV blocks, sequence slots or queue places for this request
    right now (RESOURCE_EXHAUSTED: the client may retry later or elsewhere)."""


class Stage(enum.Enum):
    """Where a request stands on one node."""

    QUEUED = "queued"  # in the engine's queue, nothing computed yet
    # Prompt being computed (either node), or awaited from a prefill node (decode node).
    PREFILL = "prefill"
    TRANSFER = "transfer"  # KV gathered and on the wire (prefill node)
    ADMISSION = "admission"  # decode node: KV landed, not yet in the running batch
    DECODE = "decode"  # decode node: generating


@dataclass(slots=True)
class AbortCounters:
    """Requests aborted (cancelled, deadline, peer failure, lease) per stage."""

    by_stage: Counter = field(default_factory=Counter)
    deadline_exceeded: int = 0

    def aborted(self, stage: Stage) -> None:
        self.by_stage[stage] += 1

    def counters(self) -> dict[str, int]:
        """NodeInfo field names (published with every heartbeat)."""
        out = {f"aborted_{s.value}": self.by_stage[s] for s in Stage}
        out["deadline_exceeded"] = self.deadline_exceeded
        return out


def deadline_passed(deadline: float | None) -> bool:
    """Whether a request's deadline is (about) now: gRPC cancels a call at its
    deadline by its own clock, a little before ours (read when the call
    started), so a few tens of milliseconds count as passed."""
    return deadline is not None and time.monotonic() >= deadline - 0.05


def check_queue(num_waiting: int, free_slots: int, max_queued: int, node_id: str) -> None:
    """Refuse a new request when ``max_queued`` requests already wait beyond the
    sequence slots still free (0: no bound).

    A bounded queue turns a burst into quick RESOURCE_EXHAUSTED answers that
    the router can send elsewhere, instead of latency that grows without bound
    for everyone and memory that grows with the burst. Free slots count as
    room: requests that arrive together wait for the next step to start.
    """
    queued = num_waiting - max(0, free_slots)
    if max_queued and queued >= max_queued:
        raise NoCapacity(
            f"node {node_id} has {queued} requests queued (--max-queued-requests "
            f"{max_queued}); try again later"
        )


class FaultPoint(enum.Enum):
    """Places where tests/faults can hold a request (test-only; zero otherwise)."""

    # Prefill node's sender: a request's last group of KV segments held after its
    # first chunk (headers and one chunk out, the rest not: a stream in the middle).
    TRANSFER_MID = "transfer_mid"
    # Decode node: KV landed, before the request joins the running batch.
    DECODE_BEFORE_COMMIT = "decode_before_commit"
    # Prefill node: after every engine step (a slow or busy accelerator), so
    # that requests behind a long prompt wait in the queue for a while.
    PREFILL_STEP = "prefill_step"
    # Prefill node: a computed and sent request's reply held (its decode node
    # has the KV and the first token long before; nothing waits for the reply).
    PREFILL_REPLY = "prefill_reply"


@dataclass(slots=True, frozen=True)
class FaultDelays:
    """Seconds to wait at each FaultPoint, from PDSERVE_FAULT_DELAYS="point=s,...".

    Only the fault-injection suite sets it; nodes log a warning when it is set.
    """

    delays: Mapping[FaultPoint, float] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultDelays:
        spec = environ.get(FAULT_DELAYS_ENV, "").strip()
        delays: dict[FaultPoint, float] = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, sep, value = item.partition("=")
            try:
                point = FaultPoint(name.strip())
                seconds = float(value) if sep else float("nan")
            except ValueError:
                raise ValueError(
                    f"{FAULT_DELAYS_ENV}: bad item {item!r}; expected point=seconds with point "
                    f"one of {', '.join(p.value for p in FaultPoint)}"
                ) from None
            if not seconds >= 0:
                raise ValueError(f"{FAULT_DELAYS_ENV}: {name} needs a delay >= 0, got {value!r}")
            delays[point] = seconds
        return cls(delays)

    def __bool__(self) -> bool:
        return any(self.delays.values())

    def get(self, point: FaultPoint) -> float:
        return self.delays.get(point, 0.0)

    def sleep(self, point: FaultPoint) -> None:
        """Blocking wait (sender thread)."""
        if seconds := self.get(point):
            time.sleep(seconds)


def crash_at_start(node_id: str, environ: Mapping[str, str] = os.environ) -> None:
    """Crash (RuntimeError: exit code 1) when ``node_id`` is listed in
    PDSERVE_FAULT_CRASH_AT_START="id,id,..." (test-only, like the delays)."""
    listed = {s.strip() for s in environ.get(CRASH_AT_START_ENV, "").split(",")}
    if node_id in listed:
        raise RuntimeError(f"{node_id}: crashing at start-up, as {CRASH_AT_START_ENV} asks")
