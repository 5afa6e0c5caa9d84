"""The device and dtype an engine runs on."""

from __future__ import annotations

import contextlib
import os

import torch

from engine.config import DeviceKind

GiB = 1 << 30

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(kind: DeviceKind) -> torch.device:
    if kind is DeviceKind.CUDA and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available on this host")
    if kind is DeviceKind.CPU or (kind is DeviceKind.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        # fp32 on CPU: half-precision matmuls are slow on most CPUs and fp32 is
        # what the correctness tests compare against.
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return DTYPES[checkpoint_dtype]
    return torch.bfloat16


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def available_host_memory() -> int:
    """Free host memory, bounded by the container's cgroup limit where there is one."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX hosts
        free = 8 * GiB
    for path, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            with open(path) as f, open(usage) as g:
                limit_text, used = f.read().strip(), int(g.read().strip())
        except (OSError, ValueError):
            continue
        if limit_text.isdigit():
            free = min(free, max(0, int(limit_text) - used))
        break
    return free
