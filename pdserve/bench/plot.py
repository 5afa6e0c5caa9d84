"""Plots of one or more sweep records, one curve per system (record label).

Three panels: TTFT p90 and TPOT p90 against the offered request rate (rate
inf is drawn at the throughput it reached), and output tok/s per GPU against
output tok/s per user (the throughput/interactivity trade-off; up and to the
right is better). A record of a run on no GPU (its environment names no
server device, or a CPU) is drawn at the server's total output tok/s, and the
axis says so.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _x_rate(r: dict[str, Any]) -> float:
    rate = r["request_rate"]
    return r["request_throughput"] if math.isinf(rate) else rate


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def gpus_of(record: dict[str, Any]) -> int:
    """What a record's throughput is divided by: its --num-gpus where it ran on
    GPUs (its environment names the server's device), else 0 (a CPU run, or an
    unknown device: the server's total)."""
    device = (record.get("environment") or {}).get("server_device")
    if not device or "cpu" in device.lower():
        return 0
    return max(1, int(record["parameters"].get("num_gpus") or 1))


def throughput_label(records: list[dict[str, Any]]) -> str:
    """The throughput axis's name: per GPU only for records that ran on GPUs."""
    kinds = {gpus_of(r) > 0 for r in records}
    if kinds == {True}:
        return "output tok/s per GPU"
    if kinds == {False}:
        return "output tok/s"
    return "output tok/s per GPU (runs on no GPU: total)"


def plot_records(records: list[dict[str, Any]], out: Path) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "plots need matplotlib: pip install 'pdserve[bench]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.6))
    for rec in records:
        rates = sorted(rec["rates"], key=_x_rate)
        gpus = gpus_of(rec) or 1
        label = f"{rec['label']} ({rec['dataset']})"
        xs = [_x_rate(r) for r in rates]
        a.plot(xs, [_num(r["ttft_ms"]["p90"]) for r in rates], "o-", label=label)
        b.plot(xs, [_num(r["tpot_ms"]["p90"]) for r in rates], "o-", label=label)
        c.plot(
            [_num(r["output_tokens_per_s_per_user"]) for r in rates],
            [r["output_throughput"] / gpus for r in rates],
            "o-",
            label=label,
        )
    a.set(xlabel="request rate (req/s)", ylabel="TTFT p90 (ms)", title="Time to first token")
    b.set(xlabel="request rate (req/s)", ylabel="TPOT p90 (ms)", title="Time per output token")
    c.set(
        xlabel="output tok/s per user",
        ylabel=throughput_label(records),
        title="Throughput vs interactivity",
    )
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
