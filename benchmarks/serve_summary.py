"""serve_side_by_side.py's summary: plots per workload, the issue's targets
from the records, the servers' phases and pdserve's garbage-collector pauses,
and for interleaved runs the rounds side by side."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from statistics import mean

GC_PAUSE = re.compile(r"garbage collection \(generation (\d)\) paused this process for (\d+) ms")
GC_FROZE = re.compile(r"froze (\d+) start-up objects")


def gc_pauses(log_dir: Path) -> dict:
    """Per pdserve process log: objects frozen at start-up and the collector's long
    pauses once serving (common/gc_heap.py logs each one over 50 ms; those of
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
    goodput, less TTFT). Empty where no label has a round."""
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
        per_system = {
            system: {
                rate: {"rounds": vals, "mean": mean(vals)}
                for rate in rounds[min(rounds)]
                if (vals := [rounds[r][rate] for r in sorted(rounds) if rate in rounds[r]])
            }
            for system, rounds in by_system.items()
        }
        paired = {}
        vllm = by_system.get("vllm", {})
        for system, rounds in by_system.items():
            common = sorted(set(rounds) & set(vllm)) if system != "vllm" else []
            if not common:
                continue
            paired[f"{system} - vllm"] = {}
            for rate in rounds[common[0]]:
                diffs = [rounds[r][rate] - vllm[r][rate] for r in common if rate in vllm[r]]
                ahead = sum((d >= 0) if more_is_better else (d <= 0) for d in diffs)
                paired[f"{system} - vllm"][rate] = {
                    "diffs": diffs,
                    "mean": mean(diffs),
                    "rounds_at_or_ahead": f"{ahead} of {len(diffs)}",
                }
        out[f"{key}_rounds"] = {"per_system": per_system, "paired": paired}
    return out


def summarize(out: Path, workloads: list[str], compiled: dict[str, list[str]]) -> dict:
    """Plots per workload and the issue's two targets, from the records."""
    from pdserve.bench.plot import plot_records
    from pdserve.bench.report import load_record

    summary: dict = {}
    for workload in workloads:
        recs = [load_record(p) for p in sorted(out.glob(f"serve-*-{workload}-*.json"))]
        if not recs:
            continue
        plot_records(recs, out / f"plot-{workload}.png")
        per = {r["label"]: r["rates"] for r in recs}
        if workload == "random":
            summary["random_max_goodput"] = {
                k: max((x["goodput"] or 0.0) for x in v) for k, v in per.items()
            }
        else:
            summary["shared_prefix_ttft_p50_ms"] = {
                k: {str(x["request_rate"]): x["ttft_ms"]["p50"] for x in v} for k, v in per.items()
            }
        summary[f"{workload}_failed"] = {k: sum(x["failed"] for x in v) for k, v in per.items()}
        summary[f"{workload}_server_phases"] = {
            k: {str(x["request_rate"]): server_phases(x) for x in v} for k, v in per.items()
        }
    summary.update(rounds_summary(summary))
    summary["triton_compiled_during_sweeps"] = compiled
    if (out / "logs-pdserve").is_dir():
        summary["pdserve_gc"] = gc_pauses(out / "logs-pdserve")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(json.dumps(summary, indent=2, default=str))
    return summary
