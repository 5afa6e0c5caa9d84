"""benchmarks/serve_path.py's figures: a first token's hops, each sweep's summary
and line, and the rounds' summary per rate and mode."""

from __future__ import annotations

from statistics import median
from typing import Any

from benchmarks.common import summary_ms

# (name, from, to): the hops of a first token, in order; the engine mode has no gRPC.
HOPS = (
    ("to_node", "sent", "received"),
    ("prepare", "received", "submitted"),
    ("handoff", "submitted", "added"),
    ("queued", "added", "scheduled"),
    ("computed", "scheduled", "first_token"),
    ("to_loop", "first_token", "sink"),
    ("loop", "sink", "yielded"),
    ("to_client", "yielded", "first"),
    ("write", "yielded", "written"),
    # The serving path's share as two spans: in, to the engine thread adding the
    # request; out, from the first token read on the host to the client.
    ("way_in", "sent", "added"),
    ("way_out", "first_token", "first"),
)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in records if "first" in r and "end" in r]
    out: dict[str, Any] = {"completed": len(done), "failed": len(records) - len(done)}
    out["ttft_ms"] = summary_ms([(r["first"] - r["sent"]) * 1e3 for r in done])
    tpot = [
        (r["end"] - r["first"]) * 1e3 / (r["tokens"] - 1) for r in done if r.get("tokens", 0) > 1
    ]
    out["tpot_ms"] = summary_ms(tpot)
    hops = {}
    for name, a, b in HOPS:
        values = [(r[b] - r[a]) * 1e3 for r in done if r.get(a) and r.get(b)]
        if values:
            hops[name] = summary_ms(values)
    out["hops_ms"] = hops
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def line(mode: str, s: dict[str, Any]) -> str:
    ttft, tpot = s["ttft_ms"], s["tpot_ms"]
    hops = ", ".join(f"{k} {v['mean_ms']:.1f}/{v['p50_ms']:.1f}" for k, v in s["hops_ms"].items())
    cpu = ", ".join(f"{k} {v:.0f}" for k, v in s["cpu_us_per_token"].items())
    runq = ", ".join(f"{k} {v:.0f}" for k, v in s["runq_wait_us_per_token"].items())
    gil = s["gil_lag_us"]
    return (
        f"{mode:12s} TTFT p50 {ttft['p50_ms']:6.1f} p90 {ttft['p90_ms']:6.1f} mean"
        f" {ttft['mean_ms']:6.1f} | TPOT p50 {tpot['p50_ms']:5.1f} p90 {tpot['p90_ms']:5.1f} | hops mean/p50 ms: {hops}"
        f" | CPU us/token: {cpu} | waiting for a CPU us/token: {runq} | GIL lag p50/p90 us {gil['p50']:.0f}/{gil['p90']:.0f}"
        + (f" | FAILED {s['failed']}" if s["failed"] else "")
        + (f" | launches {late}" if (late := s.get("late_launch")) else "")
    )


def lag_summary(lags: list[float]) -> dict[str, float]:
    return {"count": len(lags), "p50": percentile(lags, 0.5), "p90": percentile(lags, 0.9)}


def summarize_rounds(args, sweeps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rate and mode: TTFT p50 of each round, and the median over rounds of
    the TTFT's and each hop's p50 (a hop's p50s do not add up; their means do)."""
    summary: dict[str, Any] = {}
    for rate in args.request_rate:
        for mode in args.modes:
            mine = [s for s in sweeps if s["mode"] == mode and s["request_rate"] == rate]
            if not mine:
                continue
            p50s = [s["ttft_ms"]["p50_ms"] for s in mine]
            hops = {
                name: median([s["hops_ms"][name]["p50_ms"] for s in mine if name in s["hops_ms"]])
                for name, _, _ in HOPS
                if name in mine[0]["hops_ms"]
            }
            summary[f"{mode}@{rate:g}"] = {
                "ttft_p50_ms_per_round": p50s,
                "ttft_p50_ms_median": median(p50s),
                "hop_p50_ms_median": hops,
            }
            print(
                f"{mode:6s} @ {rate:g} req/s: TTFT p50 per round "
                f"{', '.join(f'{x:.1f}' for x in p50s)}; median hop p50s "
                + ", ".join(f"{k} {v:.2f}" for k, v in hops.items())
            )
    return summary
