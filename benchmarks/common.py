"""Shared benchmark plumbing: environment facts and JSON records."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.devices import cpu_model, describe
from pdserve.bench.report import git_revision

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    import torch
    import transformers

    from engine import block_hash

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pdserve_revision": git_revision(),
        "host": platform.node(),
        "cpu_count": __import__("os").cpu_count(),
        # The C extension (engine/_block_hash.c) or hashlib and Python's own
        # scans: a tree copied to a host of another Python runs without it
        # unless it is built there, and a request's path is slower.
        "block_hash_native": block_hash.NATIVE_AVAILABLE,
        # The same extension's one-pass check of a prompt's ids (an extension
        # built from an older source has the chain but not this).
        "id_bounds_native": block_hash.ID_BOUNDS_NATIVE,
    }
    # The device the run measured: the current GPU, and every GPU the process
    # sees (a two-GPU suite's record names both); on a CPU, its model.
    env["cpu"] = cpu_model()
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["devices"] = describe(
            [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        )
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"cpu ({env['cpu']})"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def triton_cache_entries() -> set[Path]:
    """The kernel metadata files in Triton's on-disk cache (``TRITON_CACHE_DIR``),
    one per compiled variant: what appears between two reads was compiled between them."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {p for p in root.glob("*/*.json") if not p.name.startswith("__grp__")}


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that reproduces this run, as a user would type it."""
    return shlex.join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def write_record(
    name: str, record: dict[str, Any], command: str, out_dir: Path | None = None
) -> tuple[Path, dict[str, Any]]:
    """Write the record with its name, time and command line; returns (path, full record)."""
    out_dir = out_dir or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{name}-{stamp}.json"
    record = {"benchmark": name, "timestamp": stamp, "command": command, **record}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path, record


def save_run(name: str, args: Any, results: Any, argv: list[str] | None) -> dict[str, Any]:
    """Record one benchmark run (environment, flags, results, command) and say where."""
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    record = {"environment": environment(), "parameters": params, "results": results}
    path, record = write_record(name, record, command_line(f"{name}.py", argv), args.out_dir)
    print(f"record: {path}")
    return record


# ----------------------------------------------------------------- GPU timing
def cuda_time_ms(fn, warmup: int = 3, iters: int = 20, batch: int = 1) -> float:
    """Median wall time of ``fn`` on the GPU in ms (CUDA events around each call;
    with ``batch`` > 1 around that many calls back to back, divided: for kernels
    short enough that the host's launch gap would show between two events)."""
    return cuda_times_ms_interleaved({"fn": fn}, warmup, iters, batch)["fn"]


def rotated(names: list[str], round_index: int) -> list[str]:
    """Round ``round_index``'s order of ``names``: rotated by one each round, so
    that every name is first (and last) equally often over ``len(names)`` rounds."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def interleaved_order(names: list[str], iters: int) -> list[str]:
    """The order in which ``cuda_times_ms_interleaved`` times ``names``: one call
    of each per round, each round ``rotated``."""
    return [name for i in range(iters) for name in rotated(names, i)]


def cuda_times_ms_interleaved(
    fns: dict[str, Callable[[], object]], warmup: int = 3, iters: int = 20, batch: int = 1
) -> dict[str, float]:
    """``cuda_time_ms`` of several functions whose times are compared: their
    timed calls interleaved (``interleaved_order``) instead of each timed in a
    block of its own, so that a drift of the device over the run (clocks,
    temperature, the caches a block leaves warm) falls on all of them alike:
    timed block by block, two bit-identical kernels differed by up to 11%, the
    first block favoured."""
    import torch

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in interleaved_order(list(fns), iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fns[name]()
        end.record()
        end.synchronize()
        times[name].append(start.elapsed_time(end) / batch)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def measure_copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read and written."""
    import torch

    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * n * 2 / (ms / 1e3)


def measure_matmul_flops(size: int = 8192) -> float:
    """bf16 dense matmul rate in FLOP/s on random data."""
    import torch

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    ms = cuda_time_ms(lambda: a @ b, warmup=3, iters=10)
    return 2 * size**3 / (ms / 1e3)


def summary_ms(values: list[float]) -> dict[str, float]:
    from router.stats import summarize  # the percentiles pdctl stats reports

    s = summarize(values)
    return {"count": s.count, "mean_ms": s.mean, "p50_ms": s.p50, "p90_ms": s.p90, "p99_ms": s.p99}


def add_numerics_args(p: argparse.ArgumentParser) -> None:
    """``--quantization`` and ``--kv-cache-dtype``, under the engine's (and vLLM's) names."""
    from engine.kv_cache_dtype import KVCacheDType

    p.add_argument("--quantization", choices=["fp8"], help="FP8 weights, quantized at load")
    p.add_argument(
        "--kv-cache-dtype",
        choices=[d.value for d in KVCacheDType],
        default=KVCacheDType.AUTO.value,
        help="what the KV cache stores (auto: the model's dtype)",
    )
