"""Builders for the metric families our collectors yield at scrape time."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from common.metrics.histogram import Histogram


def gauge(name: str, doc: str, labels: Mapping[str, str], value: float) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def counter(name: str, doc: str, labels: Mapping[str, str], value: float) -> Metric:
    """``name`` ends in ``_total``; prometheus-client keeps it on the sample only."""
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def labelled_counter(
    name: str, doc: str, labels: Mapping[str, str], key: str, values: Mapping[str, float]
) -> Metric:
    """One counter per value of the label ``key`` (plus the constant ``labels``)."""
    family = CounterMetricFamily(name, doc, labels=[*labels, key])
    for k, v in values.items():
        family.add_metric([*labels.values(), k], v)
    return family


def histogram(name: str, doc: str, labels: Mapping[str, str], hist: Histogram) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    _add_histogram(family, list(labels.values()), hist)
    return family


def labelled_histogram(
    name: str, doc: str, labels: Mapping[str, str], key: str, hists: Mapping[str, Histogram]
) -> Metric:
    """One histogram per value of the label ``key`` (plus the constant ``labels``)."""
    family = HistogramMetricFamily(name, doc, labels=[*labels, key])
    for k, hist in hists.items():
        _add_histogram(family, [*labels.values(), k], hist)
    return family


def _add_histogram(family: HistogramMetricFamily, values: list[str], hist: Histogram) -> None:
    snap = hist.snapshot()
    family.add_metric(
        values,
        buckets=[(floatToGoString(bound), n) for bound, n in snap.buckets],
        sum_value=snap.sum,
    )
