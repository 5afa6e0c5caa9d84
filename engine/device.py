"""The device and dtype an engine runs on."""

from __future__ import annotations

import contextlib

import torch

from engine.config import DeviceKind

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
