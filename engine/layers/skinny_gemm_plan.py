"""Which projections run the skinny kernel (engine/layers/skinny_gemm.py), for which
token counts, with which launch configuration.

``plan_model`` runs once per model on CUDA, before the CUDA graphs are
captured, and gives each layer that routes through ``linear`` a ``GemvPlan``:

- ``torch``: no plan, ``F.linear`` everywhere;
- ``triton``: the kernel for every token bucket (the tuned config, else the
  default one);
- ``auto``: per weight shape and token bucket, the tuned table's verdict for
  this GPU, where ``benchmarks/tune_kernels.py --part gemv`` timed its best
  config against cuBLAS in the same run; a shape the table lacks is measured
  here, the default config against ``F.linear``. Either way the kernel is used only where it was
  faster by ``MARGIN``.

Timing (``time_graph_us``): the calls run back to back inside one CUDA graph,
as a decode step runs them, each on its own copy of the weight so that no
call reads it from L2 (a decode step reads every weight from HBM).

Tables: ``skinny_gemm_configs/<GPU name>.json`` beside this file:
``{"bfloat16": {"4096x1024": {"1": {"config": {...}, "triton_us": 3.1,
"cublas_us": 5.2}, ...}}}`` (N x K of the weight, then the token bucket).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.skinny_gemm import M_BUCKETS, GemvConfig, GemvPlan, default_config
from engine.layers.specs import GemvBackend
from engine.layers.tuned_tables import read_table, table_file_name

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "skinny_gemm_configs"
MARGIN = 0.97  # the kernel is chosen only when it takes at most 97% of cuBLAS's time
ROTATE_BYTES = 256 << 20  # weight copies per timing: more than any L2 holds
MAX_COPIES = 64
DTYPES = (torch.bfloat16, torch.float16)


def dtype_key(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_key(n: int, k: int) -> str:
    return f"{n}x{k}"


def table_path(device: torch.device) -> Path:
    return CONFIG_DIR / table_file_name(torch.cuda.get_device_name(device))


def load_table(path: Path) -> dict:
    return read_table(path, "skinny GEMM", "measuring instead")


def choose(entry: dict | None, backend: GemvBackend) -> tuple[bool, GemvConfig | None]:
    """From a table entry: (found, config to use or None for cuBLAS)."""
    if entry is None or entry.get("config") is None:
        return False, None
    cfg = GemvConfig.from_dict(entry["config"])
    if backend is GemvBackend.TRITON:
        return True, cfg
    faster = entry["triton_us"] <= MARGIN * entry["cublas_us"]
    return True, cfg if faster else None


# ---------------------------------------------------------------- timing
def time_graph_us(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median time per call of ``calls`` run back to back in one CUDA graph (us)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation) off the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return 1e3 * times[len(times) // 2] / len(calls)


def rotating_weights(n: int, k: int, dtype: torch.dtype, device: torch.device) -> list:
    """Enough copies of an [n, k] weight that cycling through them defeats the L2."""
    nbytes = n * k * torch.empty(0, dtype=dtype).element_size()
    copies = max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / nbytes)))
    return [torch.randn(n, k, dtype=dtype, device=device) * 0.02 for _ in range(copies)]


def time_cublas_and_configs(
    n: int, k: int, m: int, dtype: torch.dtype, device: torch.device, configs: Iterable
) -> tuple[float, list[float | None]]:
    """(F.linear's us, each config's us or None where it failed) at m tokens."""
    from engine.layers.skinny_gemm_kernels import skinny_gemm

    weights = rotating_weights(n, k, dtype, device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    cublas = time_graph_us([functools.partial(F.linear, x, w) for w in weights])
    out: list[float | None] = []
    for cfg in configs:
        try:
            out.append(
                time_graph_us([functools.partial(skinny_gemm, x, w, None, cfg) for w in weights])
            )
        except Exception as e:  # too much shared memory, too many registers...
            logger.debug("skinny GEMM config %s failed on %dx%d: %s", cfg, n, k, e)
            out.append(None)
    del weights
    return cublas, out


@functools.cache
def _measured(device_index: int, dtype: torch.dtype, n: int, k: int, m: int) -> GemvConfig | None:
    """The default config where it beats cuBLAS on this GPU, else None (per process)."""
    device = torch.device("cuda", device_index)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    cfg = default_config(m, n, k, num_sms)
    with torch.cuda.device(device):
        cublas, (ours,) = time_cublas_and_configs(n, k, m, dtype, device, [cfg])
    logger.debug("skinny GEMM %dx%d m=%d: %s us vs cuBLAS %.2f us", n, k, m, ours, cublas)
    return cfg if ours is not None and ours <= MARGIN * cublas else None


# ---------------------------------------------------------------- planning
def plan_model(
    model: nn.Module, backend: GemvBackend, device: torch.device, dtype: torch.dtype
) -> dict[tuple[int, int], GemvPlan]:
    """Give every layer that routes through ``linear`` its plan; returns the plans by
    weight shape (empty: every layer uses F.linear)."""
    layers = [m for m in model.modules() if getattr(m, "routes_through_skinny_gemm", False)]
    for layer in layers:
        layer.gemv_plan = None
    if backend is GemvBackend.TORCH or device.type != "cuda" or dtype not in DTYPES:
        return {}
    try:
        import engine.layers.skinny_gemm_kernels  # noqa: F401
    except ImportError as e:
        logger.info("skinny GEMM off: %s", e)
        return {}
    start = time.perf_counter()
    path = table_path(device)
    table = load_table(path).get(dtype_key(dtype), {})
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    plans: dict[tuple[int, int], GemvPlan] = {}
    measured = 0
    for layer in layers:
        n, k = layer.weight.shape
        if (n, k) not in plans:
            configs: dict[int, GemvConfig | None] = {}
            for m in M_BUCKETS:
                found, cfg = choose(table.get(shape_key(n, k), {}).get(str(m)), backend)
                if not found:
                    if backend is GemvBackend.TRITON:
                        cfg = default_config(m, n, k, num_sms)
                    else:
                        cfg = _measured(device.index or 0, dtype, n, k, m)
                        measured += 1
                configs[m] = cfg
            plans[(n, k)] = GemvPlan(configs)
        layer.gemv_plan = plans[(n, k)]
    summary = ", ".join(
        f"{n}x{k}: m in {[m for m, c in p.configs.items() if c is not None] or 'none'}"
        for (n, k), p in plans.items()
    )
    logger.info(
        "skinny GEMM (%s; table %s%s) in %.1f s: %s",
        backend.value,
        path.name if table else "none for this GPU",
        f", {measured} measured" if measured else "",
        time.perf_counter() - start,
        summary,
    )
    return plans
