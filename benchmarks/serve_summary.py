"""serve_side_by_side.py's summary: plots per workload, the issue's targets
from the records, the servers' phases and pdserve's garbage-collector pauses,
and for interleaved runs the rounds side by side (``plot_rounds``, also
``serve_side_by_side.py --plot-rounds``)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GC_PAUSE = re.compile(r"garbage collection \(generation (\d)\) paused this process for (\d+) ms")
GC_FROZE = re.compile(r"froze (\d+) start-up objects")


def gc_pauses(log_dir: Path) -> dict:
    """Per pdserve process log: objects frozen at start-up and the collector's long
    pauses once serving (common/runtime/gc_heap.py logs each one over 50 ms; those of
    start-up, before the process says it is serving, are left out)."""
    found = {}
    for path in sorted(log_dir.glob("*.log")):
        text = path.read_text(errors="replace")
        serving = text.find(" serving on ")
        frozen = GC_FROZE.findall(text)
        text = text[serving:] if serving >= 0 else ""
        pauses = [int(ms) for _, ms in GC_PAUSE.findall(text)]
        found[path.stem] = {
            "frozen": int(frozen[-1]) if frozen else 0,
            "pauses_over_50ms": len(pauses),
            "max_pause_ms": max(pauses, default=0),
            "total_pause_ms": sum(pauses),
        }
    return found


def server_phases(rate: dict) -> dict[str, float] | None:
    """A rate's server-side queue and prefill time, mean and p90 in ms, from the
    histograms its record scraped (vLLM's ``vllm:request_*_time_seconds``, a
    pdserve node's ``pdserve_request_*_time_seconds``); None without them. With
    several series of a phase (nodes, labels): the one that observed the most.
    The p90 is an estimate within its bucket, whose upper bound comes with it
    (``*_p90_at_most_ms``, None past the last bucket): vLLM's first bucket is
    (0, 300 ms]."""
    out = {}
    for series in (rate.get("server_histograms") or {}).values():
        for key, s in series.items():
            for phase in ("queue", "prefill"):
                named = f"request_{phase}_time_seconds" in key.split("{")[0]
                if named and s["count"] > out.get(f"{phase}_n", 0):
                    out[f"{phase}_n"] = s["count"]
                    out[f"{phase}_mean_ms"] = s["mean"]
                    out[f"{phase}_p90_ms"] = s["p90"]
                    if "p90_bucket" in s:
                        # Past the last bucket there is no bound (a record writes inf as "inf").
                        upper = s["p90_bucket"][1]
                        bounded = isinstance(upper, (int, float)) and math.isfinite(upper)
                        out[f"{phase}_p90_at_most_ms"] = upper if bounded else None
    return out or None


ROUND = re.compile(r"^(.*)-r(\d+)$")


def rounds_summary(summary: dict) -> dict:
    """For ``--interleave``: a target figure's rounds gathered per system (its
    mean), and pdserve's minus vLLM's round by round (the same prompts, one
    sweep after the other) with how many rounds pdserve was at or ahead (more
    goodput, less TTFT). A rate is paired only in rounds where both systems
    ran it (a partial sweep leaves some out). Empty where no label has a round."""
    out: dict = {}
    for key, more_is_better in (("random_max_goodput", True), ("shared_prefix_ttft_p50_ms", False)):
        by_system: dict[str, dict[int, dict[str, float]]] = {}
        for label, value in summary.get(key, {}).items():
            if m := ROUND.match(label):
                # One shape for both figures: {rate: value}, "best" for goodput.
                figure = value if isinstance(value, dict) else {"best": value}
                by_system.setdefault(m[1], {})[int(m[2])] = figure
        if not by_system:
            continue
        per_system = {}
        for system, rounds in by_system.items():
            rates = sorted({rate for fig in rounds.values() for rate in fig}, key=_rate_key)
            per_system[system] = {
                rate: {"rounds": vals, "mean": mean(vals)}
                for rate in rates
                if (vals := [rounds[r][rate] for r in sorted(rounds) if rate in rounds[r]])
            }
        paired = {}
        vllm = by_system.get("vllm", {})
        for system, rounds in by_system.items():
            if system == "vllm":
                continue
            pairs: dict[str, dict] = {}
            for rate in per_system[system]:
                both = [r for r in sorted(rounds) if rate in rounds[r] and rate in vllm.get(r, {})]
                if not both:
                    continue
                diffs = [rounds[r][rate] - vllm[r][rate] for r in both]
                ahead = sum((d >= 0) if more_is_better else (d <= 0) for d in diffs)
                pairs[rate] = {
                    "rounds": both,
                    "diffs": diffs,
                    "mean": mean(diffs),
                    "rounds_at_or_ahead": f"{ahead} of {len(diffs)}",
                }
            if pairs:
                paired[f"{system} - vllm"] = pairs
        out[f"{key}_rounds"] = {"per_system": per_system, "paired": paired}
    return out


def _rate_key(rate: str) -> float:
    try:
        return float(rate)
    except ValueError:  # "best"
        return math.inf


# What each workload's target reads off a rate (the summary's figures, the
# rounds plot's points), and how a plot names it.
TARGET_FIGURES = {
    "shared-prefix": ("TTFT p50 (ms), lower is better", lambda x: x["ttft_ms"]["p50"]),
    "random": ("goodput (req/s), higher is better", lambda x: x["goodput"] or 0.0),
    "multi-turn": ("TTFT p50 (ms), lower is better", lambda x: x["ttft_ms"]["p50"]),
}

# The host KV tier's targets: TTFT p50 against the same server without a tier
# at the same rate, and the tier's copy-in rate against the host's plain copy.
TTFT_SPEEDUP_TARGET = 2.0
COPY_IN_TARGET = 0.7
# A label with one of these is a system with a host KV tier; without it, the
# same system without one (pdserve-host-tier-http / pdserve-http, vllm-offload / vllm).
TIERED = ("-host-tier", "-offload")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _ratio(num: float | None, den: float | None) -> float | None:
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (num, den))
    return num / den if ok and den > 0 else None


def multi_turn_summary(per: dict[str, list[dict]], out: Path) -> dict:
    """Per system and rate TTFT p50 / p90 and goodput; each tiered system
    against the same one without a tier at each rate; the working set over
    the pool; the tier's copy-in rate against the host's copy rate."""
    figures = {
        label: {
            str(x["request_rate"]): {
                "ttft_p50_ms": x["ttft_ms"]["p50"],
                "ttft_p90_ms": x["ttft_ms"]["p90"],
                "goodput": x["goodput"],
                "completed": x["completed"],
                "failed": x["failed"],
            }
            for x in rates
        }
        for label, rates in per.items()
    }
    paired = {}
    for label, by_rate in figures.items():
        for mark in TIERED:
            base = label.replace(mark, "", 1)
            if mark in label and base in figures:
                paired[f"{label} vs {base}"] = {
                    rate: _against(f, figures[base][rate])
                    for rate, f in by_rate.items()
                    if rate in figures[base]
                }
    return {
        "multi_turn": figures,
        "multi_turn_tier_vs_without": paired,
        "multi_turn_working_set": _read_json(out / "working-set.json"),
        "host_tier_copy_in": copy_in_summary(out),
        "host_tier_targets": {
            "ttft_p50_speedup_at_least": TTFT_SPEEDUP_TARGET,
            "copy_in_over_copy_rate_at_least": COPY_IN_TARGET,
        },
    }


def _against(tier: dict, base: dict) -> dict:
    """A tiered system's rate against the same rate without the tier."""
    p50 = _ratio(base["ttft_p50_ms"], tier["ttft_p50_ms"])
    return {
        "ttft_p50_speedup": p50,
        "ttft_p90_speedup": _ratio(base["ttft_p90_ms"], tier["ttft_p90_ms"]),
        "goodput_with": tier["goodput"],
        "goodput_without": base["goodput"],
        "meets_ttft_target": p50 is not None and p50 >= TTFT_SPEEDUP_TARGET,
    }


def copy_in_summary(out: Path) -> dict:
    """Each pdserve system's host-tier counters (``host-tier-NAME.json``, read
    once its sweeps ended) and its copy-in rate over ``copy-rate.json``'s."""
    rate = _read_json(out / "copy-rate.json")
    host = rate["bytes_per_s"] if rate else None
    systems = {}
    for path in sorted(out.glob("host-tier-*.json")):
        counters = json.loads(path.read_text())
        ratio = _ratio(counters["copy_in_bytes_per_s"], host)
        systems[path.stem.removeprefix("host-tier-")] = {
            **counters,
            "copy_in_over_copy_rate": ratio,
            "meets_copy_in_target": ratio is not None and ratio >= COPY_IN_TARGET,
        }
    return {"copy_rate": rate, "systems": systems}


def systems_without_records(out: Path, labels: set[str]) -> list[str]:
    """Systems started (a ``logs-NAME`` folder) that left no record: a server
    that failed to start or answer (its log says why)."""
    missing = []
    for logs in sorted(out.glob("logs-*")):
        name = logs.name.removeprefix("logs-")
        own = {name, f"{name}-http", f"{name}-grpc"}
        if not any((m[1] if (m := ROUND.match(label)) else label) in own for label in labels):
            missing.append(name)
    return missing


def summarize(out: Path, workloads: list[str], compiled: dict[str, list[str]]) -> dict:
    """Plots per workload and the issue's two targets, from the records."""
    from pdserve.bench.plot import plot_records
    from pdserve.bench.report import load_record

    summary: dict = {}
    every: list[dict] = []
    for workload in workloads:
        recs = [load_record(p) for p in sorted(out.glob(f"serve-*-{workload}-*.json"))]
        if not recs:
            continue
        every += recs
        figure = TARGET_FIGURES[workload][1]
        plot_records(recs, out / f"plot-{workload}.png")
        per = {r["label"]: r["rates"] for r in recs}
        # A sweep stopped part-way (its record says so) keeps its rates, but
        # its best goodput is not the sweep's: it is listed, not ranked.
        partial = [r["label"] for r in recs if r.get("complete") is False]
        if partial:
            summary[f"{workload}_incomplete_sweeps"] = partial
        if workload == "random":
            summary["random_max_goodput"] = {
                k: max(figure(x) for x in v) for k, v in per.items() if k not in partial
            }
        elif workload == "multi-turn":
            summary.update(multi_turn_summary(per, out))
        else:
            summary["shared_prefix_ttft_p50_ms"] = {
                k: {str(x["request_rate"]): figure(x) for x in v} for k, v in per.items()
            }
        summary[f"{workload}_failed"] = {k: sum(x["failed"] for x in v) for k, v in per.items()}
        summary[f"{workload}_server_phases"] = {
            k: {str(x["request_rate"]): server_phases(x) for x in v} for k, v in per.items()
        }
    summary.update(rounds_summary(summary))
    # Each record names the device its server ran on; the summary lists them all.
    devices = {r.get("environment", {}).get("server_device") or "unknown" for r in every}
    summary["server_devices"] = sorted(devices)
    summary["systems_without_records"] = systems_without_records(out, {r["label"] for r in every})
    plot_rounds(every, out / "plot-rounds.png")
    summary["triton_compiled_during_sweeps"] = compiled
    if (out / "logs-pdserve").is_dir():
        summary["pdserve_gc"] = gc_pauses(out / "logs-pdserve")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    return summary


def rounds_series(records: list[dict]) -> dict[str, dict[str, dict[float, list[float]]]]:
    """What ``plot_rounds`` draws: per workload, per system (the label without
    its ``-rR``), per rate, each round's figure. Records without a round are
    left out."""
    series: dict[str, dict[str, dict[float, list[float]]]] = {}
    for rec in records:
        if (m := ROUND.match(rec["label"])) and rec["dataset"] in TARGET_FIGURES:
            per_rate = series.setdefault(rec["dataset"], {}).setdefault(m[1], {})
            for x in rec["rates"]:
                per_rate.setdefault(x["request_rate"], []).append(
                    TARGET_FIGURES[rec["dataset"]][1](x)
                )
    return series


def plot_rounds(records: list[dict], out: Path) -> Path | None:
    """One panel per workload of an interleaved run: each round's figure per
    rate as a small marker, the rounds' mean as a line, one colour per system.
    None (and no file) where no record has a round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = rounds_series(records)
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(6.5 * len(series), 4.6), squeeze=False)
    for ax, (workload, systems) in zip(axes[0], sorted(series.items()), strict=True):
        for colour, (system, per_rate) in enumerate(sorted(systems.items())):
            rates = sorted(per_rate)
            for rate in rates:
                ys = per_rate[rate]
                ax.plot([rate] * len(ys), ys, ".", color=f"C{colour}", alpha=0.5)
            most = max(len(v) for v in per_rate.values())
            ax.plot(
                rates,
                [mean(per_rate[r]) for r in rates],
                "-o",
                color=f"C{colour}",
                label=f"{system} (mean of up to {most} rounds)",
            )
        ax.set_title(f"{workload}, interleaved rounds")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(TARGET_FIGURES[workload][0])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
