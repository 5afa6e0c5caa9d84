"""CPU threads for the processes `pdserve up` starts on one CPU host.

Every engine process (a node, or one rank of a tensor-parallel node) would
otherwise start one OpenMP thread per core, so N processes on C cores run N x C
threads that spin while they wait for each other, and any other busy process
on the host makes it worse (docs/operations.md, "CPU threads", has the
figures). `pdserve up` therefore shares the cores out: each child gets
``OMP_NUM_THREADS`` (and ``MKL_NUM_THREADS``) = usable cores // engine
processes, at least 1. Rules, in order:

1. ``--cpu-threads N`` (``PDSERVE_CPU_THREADS``): N threads each; 0 leaves
   torch's own default.
2. ``OMP_NUM_THREADS`` already in `pdserve up`'s environment: the children
   inherit it untouched (the user chose).
3. A GPU host: torch's default (the engines' work is on the GPUs).
4. Otherwise the share above.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit included)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(slots=True, frozen=True)
class ThreadPlan:
    """What every child gets, and why (one line for `pdserve up` to print)."""

    env: dict[str, str]
    reason: str


def plan_threads(
    requested: int | None,
    engine_processes: int,
    gpus: int,
    environ: Mapping[str, str],
    cores: int | None = None,
) -> ThreadPlan:
    """The thread variables for `pdserve up`'s children (module docstring's rules)."""
    if requested is not None and requested < 0:
        raise ValueError(f"--cpu-threads must be >= 0, got {requested}")
    if requested == 0:
        return ThreadPlan({}, "CPU threads: torch's default (--cpu-threads 0)")
    if requested:
        return ThreadPlan(_vars(requested), f"CPU threads: {requested} per process (--cpu-threads)")
    if environ.get("OMP_NUM_THREADS"):
        return ThreadPlan({}, f"CPU threads: {environ['OMP_NUM_THREADS']} (OMP_NUM_THREADS)")
    if gpus:
        return ThreadPlan({}, "")  # nothing to say: torch's default, as ever
    cores = usable_cores() if cores is None else cores
    n = max(1, cores // max(1, engine_processes))
    return ThreadPlan(
        _vars(n),
        f"CPU threads: {n} per process ({cores} cores shared by {engine_processes} engine "
        "processes; --cpu-threads to change)",
    )


def _vars(n: int) -> dict[str, str]:
    return dict.fromkeys(THREAD_VARS, str(n))
