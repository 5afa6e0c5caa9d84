"""Server-side histograms over one rate: a Prometheus endpoint read before and after.

A load generator sees a stream's first token, not why it came late. Servers
say it on /metrics: vLLM as ``vllm:request_queue_time_seconds`` and
``vllm:request_prefill_time_seconds``, a pdserve node as
``pdserve_request_queue_time_seconds`` and ``pdserve_request_prefill_time_seconds``
(docs/metrics.md). ``--scrape-metrics URL`` reads every histogram there before
and after each rate, so each rate's record holds what the server observed
during that rate only: count, mean, and p50 / p90 estimated from the buckets
the way Prometheus's ``histogram_quantile`` does (linear within a bucket), each
with the bounds of the bucket it fell in: an estimate is no finer than that
bucket. vLLM's queue-time buckets start at (0, 300 ms], so a queue of
microseconds reads as a p50 of 150 ms there; the bounds and the exact mean say
what the estimate cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Histograms whose names end so are seconds: reported in ms.
SECONDS_SUFFIX = "_seconds"


@dataclass(slots=True)
class Series:
    """One histogram series (a family and its labels) at one moment."""

    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), ascending
    count: float
    sum: float


Snapshot = dict[str, Series]


def parse(text: str) -> Snapshot:
    """Every histogram series in a Prometheus text exposition, by ``name{labels}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            key = family.name + (
                "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                if labels
                else ""
            )
            entry = out.setdefault(key, {"buckets": [], "count": 0.0, "sum": 0.0})
            if s.name.endswith("_bucket"):
                entry["buckets"].append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                entry["count"] = s.value
            elif s.name.endswith("_sum"):
                entry["sum"] = s.value
    return {k: Series(sorted(v["buckets"]), v["count"], v["sum"]) for k, v in out.items()}


def _locate(
    buckets: list[tuple[float, float]], q: float
) -> tuple[float, float, float, float, float] | None:
    """Where the q-quantile falls: (lower bound, count up to it, upper bound,
    count up to that, the quantile's rank) of its bucket; None without
    observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            return lower_bound, lower_count, bound, count, rank
        lower_bound, lower_count = bound, count
    return lower_bound, lower_count, math.inf, lower_count, rank


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """``histogram_quantile``: the q-quantile from cumulative bucket counts, linear
    within the bucket it falls in (from 0 for the first); the last finite bound
    when it falls in +Inf; nan without observations."""
    found = _locate(buckets, q)
    if found is None:
        return float("nan")
    lower_bound, lower_count, bound, count, rank = found
    if math.isinf(bound):
        return lower_bound
    if count == lower_count:
        return bound
    return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)


def quantile_bucket(buckets: list[tuple[float, float]], q: float) -> tuple[float, float]:
    """The bounds (lower, upper] of the bucket the q-quantile falls in ((last
    finite bound, inf) for +Inf); (nan, nan) without observations."""
    found = _locate(buckets, q)
    if found is None:
        return (float("nan"), float("nan"))
    return (found[0], found[2])


def delta(before: Snapshot, after: Snapshot) -> dict[str, dict[str, float]]:
    """What each series observed between the two snapshots (series with none left
    out): count, mean, p50, p90 and the bucket each fell in (``p50_bucket``,
    ``p90_bucket``: [lower, upper]); in ms for ``*_seconds`` series."""
    out = {}
    for key, a in after.items():
        b = before.get(key)
        prior = dict(b.buckets) if b is not None else {}
        count = a.count - (b.count if b is not None else 0.0)
        if count <= 0:
            continue
        total = a.sum - (b.sum if b is not None else 0.0)
        buckets = [(le, c - prior.get(le, 0.0)) for le, c in a.buckets]
        scale = 1e3 if key.split("{")[0].endswith(SECONDS_SUFFIX) else 1.0
        out[key] = {
            "count": count,
            "mean": total / count * scale,
            "p50": quantile(buckets, 0.5) * scale,
            "p90": quantile(buckets, 0.9) * scale,
            "p50_bucket": [bound * scale for bound in quantile_bucket(buckets, 0.5)],
            "p90_bucket": [bound * scale for bound in quantile_bucket(buckets, 0.9)],
            "unit": "ms" if scale != 1.0 else "",
        }
    return out


# Histograms a line is printed for after each rate (all are in the record).
PRINTED = ("queue_time", "prefill_time", "idle_before_step", "step_tokens")


class Scraper:
    """The endpoints of ``--scrape-metrics``: a snapshot before each rate, the
    difference after it."""

    def __init__(self, session, urls: list[str]) -> None:
        self.session = session  # aiohttp.ClientSession
        self.urls = urls

    @classmethod
    async def start(cls, urls: list[str]) -> Scraper:
        """Reads every endpoint once: one that cannot be read stops the run here
        (SystemExit naming it), before any load, not after a whole sweep."""
        import aiohttp

        scraper = cls(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)), urls)
        try:
            await scraper.snapshot(strict=True)
        except RuntimeError as e:
            await scraper.close()
            raise SystemExit(str(e)) from None
        return scraper

    async def fetch(self, url: str) -> Snapshot:
        """The endpoint's histograms now; RuntimeError naming the URL on a failed read."""
        try:
            async with self.session.get(url) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"--scrape-metrics {url}: HTTP {resp.status}")
                return parse(await resp.text())
        except RuntimeError:
            raise
        except Exception as e:
            raise RuntimeError(f"--scrape-metrics {url}: {type(e).__name__}: {e}") from e

    async def snapshot(self, strict: bool = False) -> dict[str, Snapshot | str]:
        """Each endpoint's histograms, or (unless ``strict``) the error reading it."""
        out: dict[str, Snapshot | str] = {}
        for url in self.urls:
            try:
                out[url] = await self.fetch(url)
            except RuntimeError as e:
                if strict:
                    raise
                out[url] = str(e)
        return out

    async def since(self, before: dict[str, Snapshot | str]) -> dict[str, dict]:
        """Per endpoint, what its histograms observed since ``before`` (``delta``),
        or {"error": why} where either read failed."""
        after = await self.snapshot()
        out: dict[str, dict] = {}
        for url in self.urls:
            b, a = before[url], after[url]
            if isinstance(b, str) or isinstance(a, str):
                out[url] = {"error": b if isinstance(b, str) else a}
            else:
                out[url] = delta(b, a)
        return out

    @staticmethod
    def lines(observed: dict[str, dict]) -> str:
        rows = []
        for url, series in observed.items():
            if "error" in series:
                rows.append(f"server {url}: {series['error']}")
                continue
            for key, s in series.items():
                if any(p in key for p in PRINTED):
                    u = f" {s['unit']}" if s["unit"] else ""
                    rows.append(
                        f"server {key}: n {s['count']:.0f}, mean {s['mean']:.1f}{u}, "
                        f"p50 {s['p50']:.1f}{u}{_bucket(s.get('p50_bucket'))}, "
                        f"p90 {s['p90']:.1f}{u}{_bucket(s.get('p90_bucket'))}"
                    )
        return "\n".join(rows) or "server: no queue or prefill histogram observed anything"

    async def close(self) -> None:
        await self.session.close()


def _bucket(bounds: list[float] | None) -> str:
    """A quantile's bucket as printed: how fine the estimate beside it can be."""
    if not bounds:
        return ""
    return f" in ({bounds[0]:g}, {bounds[1]:g}]"
