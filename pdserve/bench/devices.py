"""What a benchmark record says it ran on: GPU and CPU names.

A figure without its device cannot be compared with another, so every record
names it. The load generator reads GPUs with ``nvidia-smi`` rather than torch:
it does not import torch, and it may run where none is installed.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections import Counter
from pathlib import Path


def cpu_model() -> str:
    """This host's CPU model as /proc/cpuinfo names it, else what platform knows
    (often only the architecture)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(names: list[str]) -> str | None:
    """Device names in one string: "NVIDIA H200", "2 x NVIDIA H200", or mixed
    models joined by ", " (each with its count); None for none."""
    if not names:
        return None
    return ", ".join(name if n == 1 else f"{n} x {name}" for name, n in Counter(names).items())


def local_gpus() -> list[str]:
    """The names of the NVIDIA GPUs a process started here would use: those
    CUDA_VISIBLE_DEVICES names when it is set (``nvidia-smi`` ignores it, so they
    are asked for by index or UUID), else all of the host's; empty where there
    is none, no driver, or a value nvidia-smi does not take."""
    cmd = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if not ids:
            return []  # set and empty: CUDA sees no GPU
        cmd += ["-i", ",".join(ids)]
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def server_device(label: str | None) -> str | None:
    """What a serving record names as the server's device: the ``--server-device``
    label when given (a remote server, or a GPU subset), else this host's GPUs
    (the server is taken to run beside the load generator when the host has
    any), else None: the generator cannot tell, and the record says so."""
    return label or describe(local_gpus())
