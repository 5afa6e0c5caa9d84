"""Per-rate metrics with ``vllm bench serve``'s definitions.

TTFT: send to first output. TPOT (per request): (latency - TTFT) / (output
tokens - 1), requests with one output token have none. ITL: every gap between
output chunks, all requests pooled. E2E: send to end of stream. Goodput:
requests per second that met every SLO given (TTFT, TPOT, E2E), over the same
duration as the request throughput. Failed requests count in ``failed`` and
are listed, never averaged in.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from pdserve.bench.backends import RequestResult

PERCENTILES = (50, 90, 99)


class SloMetric(enum.Enum):
    TTFT = "ttft"
    TPOT = "tpot"
    E2E = "e2el"


def parse_slo(text: str) -> dict[SloMetric, float]:
    """``ttft:500,tpot:50`` (milliseconds) -> {TTFT: 0.5, TPOT: 0.05} in seconds."""
    out: dict[SloMetric, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition(":")
        try:
            metric = SloMetric(name.strip().lower())
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"--slo: {part!r} is not NAME:MS with NAME one of ttft, tpot, e2el"
            ) from None
        if not sep or ms <= 0:
            raise ValueError(f"--slo: {part!r} needs a positive number of milliseconds")
        out[metric] = ms / 1e3
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted input."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summary_ms(values_s: list[float]) -> dict[str, float]:
    v = sorted(x * 1e3 for x in values_s)
    out = {"mean": sum(v) / len(v) if v else float("nan")}
    out.update({f"p{q}": percentile(v, q) for q in PERCENTILES})
    return out


def tpot_s(r: RequestResult) -> float | None:
    if r.output_tokens < 2:
        return None
    return (r.latency_s - r.ttft_s) / (r.output_tokens - 1)


def meets_slo(r: RequestResult, slo: dict[SloMetric, float]) -> bool:
    tpot = tpot_s(r)
    measured = {SloMetric.TTFT: r.ttft_s, SloMetric.TPOT: tpot or 0.0, SloMetric.E2E: r.latency_s}
    return all(measured[m] <= limit for m, limit in slo.items())


@dataclass(slots=True)
class RateMetrics:
    request_rate: float  # the offered rate (inf: all at once)
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None  # None when no SLO was given
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    max_concurrency: int | None = None
    # Per user: 1 / mean TPOT, the decode speed one request sees.
    output_tokens_per_s_per_user: float = float("nan")
    cached_tokens: int = 0
    # The server's own split of the first token (pdserve over gRPC), over the
    # requests that reported it: queue, then prefill, on the node that computed it.
    server_queue_ms: dict[str, float] | None = None
    server_prefill_ms: dict[str, float] | None = None
    errors: dict[str, int] = field(default_factory=dict)  # message -> count
    failures: list[dict] = field(default_factory=list)  # the first few, in full


MAX_LISTED_FAILURES = 20


def compute(
    results: list[RequestResult],
    duration_s: float,
    request_rate: float,
    slo: dict[SloMetric, float] | None = None,
    max_concurrency: int | None = None,
) -> RateMetrics:
    ok = [r for r in results if r.success]
    bad = [r for r in results if not r.success]
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    itls = [x for r in ok for x in r.itl_s]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else None
    tpot = summary_ms(tpots)
    queued = [r.server_queue_s for r in ok if r.server_queue_s is not None]
    prefilled = [r.server_prefill_s for r in ok if r.server_prefill_s is not None]
    return RateMetrics(
        request_rate=request_rate,
        duration_s=duration_s,
        completed=len(ok),
        failed=len(bad),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(in_tokens + out_tokens) / duration_s,
        goodput=None if good is None else good / duration_s,
        ttft_ms=summary_ms([r.ttft_s for r in ok]),
        tpot_ms=tpot,
        itl_ms=summary_ms(itls),
        e2el_ms=summary_ms([r.latency_s for r in ok]),
        max_concurrency=max_concurrency,
        output_tokens_per_s_per_user=1e3 / tpot["mean"] if tpots else float("nan"),
        cached_tokens=sum(r.cached_tokens for r in ok),
        server_queue_ms=summary_ms(queued) if queued else None,
        server_prefill_ms=summary_ms(prefilled) if prefilled else None,
        errors=dict(Counter(r.error for r in bad).most_common()),
        failures=[
            {"error": r.error, "prompt_len": r.prompt_len, "start_s": r.start_s}
            for r in bad[:MAX_LISTED_FAILURES]
        ],
    )
