"""The table printed after each rate and the JSON record of a whole sweep."""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pdserve.bench.devices import cpu_model
from pdserve.bench.metrics import RateMetrics

DEFAULT_RESULT_DIR = Path("benchmarks/results")


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return "nan" if math.isnan(x) else f"{x:,.{digits}f}"


def table(m: RateMetrics, slo_text: str = "") -> str:
    rate = "inf" if math.isinf(m.request_rate) else f"{m.request_rate:g}"
    rows = [
        ("request rate (offered, req/s)", rate),
        ("max concurrency", str(m.max_concurrency or "-")),
        ("completed / failed", f"{m.completed} / {m.failed}"),
        ("duration (s)", _fmt(m.duration_s, 2)),
        ("request throughput (req/s)", _fmt(m.request_throughput, 2)),
        (f"goodput (req/s, {slo_text or 'no --slo'})", _fmt(m.goodput, 2)),
        ("output tok/s", _fmt(m.output_throughput)),
        ("total tok/s", _fmt(m.total_token_throughput)),
        ("output tok/s per user", _fmt(m.output_tokens_per_s_per_user)),
    ]
    for name, s in (
        ("TTFT", m.ttft_ms),
        ("TPOT", m.tpot_ms),
        ("ITL", m.itl_ms),
        ("E2E", m.e2el_ms),
        ("server queue", m.server_queue_ms),
        ("server prefill", m.server_prefill_ms),
    ):
        if s is None:  # not reported by this server
            continue
        rows.append(
            (
                f"{name} ms mean / p50 / p90 / p99",
                " / ".join(_fmt(s[k], 2) for k in ("mean", "p50", "p90", "p99")),
            )
        )
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    for err, n in m.errors.items():
        lines.append(f"  failed x{n}: {err}")
    return "\n".join(lines)


def git_revision() -> str | None:
    """The checkout's short commit, recorded with every benchmark result, with
    "+dirty" when tracked files differ from it. ``PDSERVE_REVISION`` overrides
    it, taken as given (unchecked): a copy of the tree run elsewhere (a GPU
    host) may carry a stale .git."""
    if named := os.environ.get("PDSERVE_REVISION"):
        return named

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )

    try:
        revision = git("rev-parse", "--short", "HEAD").stdout.strip()
        if not revision:
            return None
        status = git("status", "--porcelain", "--untracked-files=no")
        if status.returncode != 0:
            return revision + "+unknown"  # cannot tell whether the tree is clean
        return revision + "+dirty" if status.stdout.strip() else revision
    except (OSError, subprocess.SubprocessError):
        return None


def _json_safe(x: Any) -> Any:
    # JSON has no inf / nan: the offered rate inf is written "inf", a missing
    # percentile null, so every reader (jq, browsers) parses the record.
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return "inf" if math.isinf(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def write_record(
    out_dir: Path,
    label: str,
    dataset: str,
    parameters: dict[str, Any],
    rates: list[tuple[RateMetrics, dict[str, Any]]],
    argv: list[str] | None,
    path: Path | None = None,
    complete: bool = True,
    stamp: str | None = None,
    server_device: str | None = None,
) -> Path:
    """One JSON file per sweep: parameters, environment and one entry per rate.

    A sweep writes it after every rate, to the ``path`` the first write chose
    (``complete`` false until the last): a sweep killed by a timeout, or one
    whose server went away, leaves the rates it finished. The file is replaced
    whole (written beside it, then renamed), so a reader never sees half.
    ``stamp``: the sweep's time (now by default), the same in every write.
    ``server_device``: the device the server ran on (devices.server_device);
    the environment names the generator's own CPU beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    if path is None:
        path = out_dir / f"serve-{label}-{dataset}-{stamp}.json"
        n = 1
        while path.exists():  # two sweeps in one second (tests) must not overwrite
            n += 1
            path = out_dir / f"serve-{label}-{dataset}-{stamp}-{n}.json"
    record = {
        "benchmark": "serve",
        "label": label,
        "dataset": dataset,
        "timestamp": stamp,
        # sys.argv: [prog, "bench", "serve", ...]; argv: what follows "serve".
        "command": shlex.join(
            ["pdserve", "bench", *sys.argv[2:]]
            if argv is None
            else ["pdserve", "bench", "serve", *argv]
        ),
        "environment": {
            "python": platform.python_version(),
            "host": platform.node(),
            "server_device": server_device,
            "generator_cpu": cpu_model(),
            "pdserve_revision": git_revision(),
            "event_loop": _event_loop_name(),
        },
        "parameters": parameters,
        "complete": complete,
        "rates": [{**asdict(m), **extra} for m, extra in rates],
    }
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(_json_safe(record), indent=2) + "\n")
    partial.replace(path)
    return path


def _event_loop_name() -> str | None:
    """The generator's event loop (``uvloop`` or ``asyncio``), None outside one."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return type(loop).__module__.split(".")[0]


def load_record(path: Path) -> dict[str, Any]:
    record = json.loads(Path(path).read_text())
    if record.get("benchmark") != "serve" or "rates" not in record:
        raise ValueError(f"{path}: not a `pdserve bench serve` record")
    for r in record["rates"]:
        if r["request_rate"] == "inf":
            r["request_rate"] = math.inf
    return record
