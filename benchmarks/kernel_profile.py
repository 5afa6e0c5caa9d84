"""Device kernels of a workload by kind: where two engines' GPU time differs.

``profile_kernels(fn)`` runs ``fn`` under torch.profiler (CUDA activity only,
so the host's Python is not slowed by CPU op tracing) and summarises every
kernel the process launched, CUDA-graph replays included: the device's busy
time (the union of kernel intervals, so overlapping streams are not counted
twice), the sum of kernel times per kind (``KINDS``) and the top kernels by
time. Both engines of offline_throughput.py's ``--profile`` go through it, so
their tables are comparable line by line: a kind that costs one engine more
device time is where its steps are slower; a gap between wall and busy time
is the host (launches, scheduling, Python).

The summary works on plain ``KernelEvent`` tuples, so the arithmetic is
tested on a CPU without a profiler.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

# (kind, pattern on the lower-cased kernel name); the first match wins, so the
# KV-cache write comes before attention (vLLM's is "reshape_and_cache_flash")
# and attention before gemm (FlashAttention's kernels are CUTLASS kernels).
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("kv_write", r"reshape_and_cache|kv_write|store_kv|write_kv|cache_kernel"),
        ("attention", r"flash|fmha|attn|attention|paged|_decode_|_prefill_"),
        ("gemm", r"gemm|nvjet|cutlass|xmma|matmul|splitk|split_k|cublas|gemv"),
        ("norm", r"rms|norm|rsqrt"),
        ("rope", r"rotary|rope"),
        ("activation", r"silu|act_and_mul|gelu|swiglu"),
        ("sampling", r"sampl|topk|top_k|softmax|argmax|exponential|gumbel|multinomial|sort"),
        ("nccl", r"nccl"),
        ("copy", r"copy|memcpy|memset|fill|cat|index|gather|scatter|elementwise|vectorized"),
    )
)


class KernelEvent(NamedTuple):
    name: str
    start_us: float
    duration_us: float


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if pattern.search(lowered):
            return kind
    return "other"


def busy_us(events: Iterable[KernelEvent]) -> float:
    """The union of the kernels' intervals: device time with something running."""
    total = 0.0
    end = float("-inf")
    for e in sorted(events, key=lambda e: e.start_us):
        stop = e.start_us + e.duration_us
        if e.start_us >= end:
            total += e.duration_us
        elif stop > end:
            total += stop - end
        end = max(end, stop)
    return total


def summarize(events: list[KernelEvent], wall_s: float, top: int = 25) -> dict[str, Any]:
    """Busy time, time per kind and the ``top`` kernels of one profiled run."""
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        for table, key in ((by_kind, kind_of(e.name)), (by_name, e.name)):
            table[key][0] += 1
            table[key][1] += e.duration_us
    busy = busy_us(events)
    return {
        "wall_s": wall_s,
        "device_busy_s": busy / 1e6,
        "kernel_sum_s": sum(e.duration_us for e in events) / 1e6,
        "kernels": len(events),
        "kinds": {
            kind: {"count": int(n), "seconds": us / 1e6}
            for kind, (n, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])
        },
        "top_kernels": [
            {"kernel": name[:160], "count": int(n), "seconds": us / 1e6, "kind": kind_of(name)}
            for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        ],
    }


def profile_kernels(fn: Callable[[], Any], top: int = 25) -> tuple[Any, dict[str, Any]]:
    """(``fn()``'s result, the summary of the CUDA kernels it ran)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [
        KernelEvent(e.name, e.time_range.start, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0
    ]
    return result, summarize(events, wall, top)


def print_summary(label: str, s: dict[str, Any]) -> None:
    print(
        f"{label}: wall {s['wall_s']:.3f} s, device busy {s['device_busy_s']:.3f} s "
        f"({100 * s['device_busy_s'] / max(s['wall_s'], 1e-9):.0f}%), {s['kernels']} kernels",
        flush=True,
    )
    for kind, row in s["kinds"].items():
        print(f"  {kind:<11} {row['seconds']:8.3f} s  {row['count']:8d} kernels", flush=True)
