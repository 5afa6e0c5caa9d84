"""The serving processes' garbage-collector policy (common/runtime/gc_heap.py)."""

from __future__ import annotations

import argparse
import gc
import logging

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.metrics.gc import GcCollector
from common.metrics.server import make_registry
from common.runtime.gc_heap import GcPauses, add_gc_arguments, freeze_heap


@pytest.fixture
def pauses():
    p = GcPauses().install()
    yield p
    p.uninstall()


@pytest.fixture
def unfreeze():
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def test_every_collection_is_counted_and_timed_by_generation(pauses):
    for generation in (0, 1, 2, 2):
        gc.collect(generation)
    # Allocations may trigger more collections of their own: at least these.
    assert pauses.collections[0] >= 1 and pauses.collections[1] >= 1
    assert pauses.collections[2] >= 2
    assert all(s > 0 for s in pauses.seconds)
    full = pauses.full_pauses.snapshot()
    assert full.count == pauses.collections[2]
    assert full.sum == pytest.approx(pauses.seconds[2])


def test_uninstalled_counts_nothing(pauses):
    pauses.uninstall()
    before = list(pauses.collections)
    gc.collect()
    assert pauses.collections == before
    pauses.uninstall()  # twice is harmless


def test_a_long_pause_is_logged(caplog):
    p = GcPauses(warn_s=0.0).install()
    try:
        with caplog.at_level(logging.WARNING, logger="common.runtime.gc_heap"):
            gc.collect()
    finally:
        p.uninstall()
    assert "garbage collection (generation 2) paused this process for" in caplog.text


def test_freeze_moves_the_heap_out_of_full_collections(unfreeze):
    alive = [{"request": i} for i in range(1000)]  # containers the collector tracks
    gc.collect()
    walked_before = len(gc.get_objects(generation=2))
    frozen = freeze_heap("test")
    assert frozen >= walked_before > 1000
    # What a full collection walks now: only what was allocated since.
    assert len(gc.get_objects(generation=2)) < walked_before // 10
    assert alive[999] == {"request": 999}


def test_flag_defaults_on_and_follows_the_variable(monkeypatch):
    def parse(*argv):
        p = argparse.ArgumentParser()
        add_gc_arguments(p)
        return p.parse_args(argv).gc_freeze

    monkeypatch.delenv("PDSERVE_GC_FREEZE", raising=False)
    assert parse() is True and parse("--no-gc-freeze") is False
    monkeypatch.setenv("PDSERVE_GC_FREEZE", "0")
    assert parse() is False and parse("--gc-freeze") is True
    monkeypatch.setenv("PDSERVE_GC_FREEZE", "yes")
    with pytest.raises(SystemExit) as info:
        parse()
    assert info.value.code == 2


def test_collector_exports_what_was_counted(pauses, unfreeze):
    frozen = freeze_heap("test")
    gc.collect()
    pauses.uninstall()  # the scrape's own allocations must not move the counts
    labels = {"role": "decode", "node": "d-1"}
    text = generate_latest(make_registry([GcCollector(pauses, labels)])).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    base = tuple(sorted(labels.items()))
    # Frozen objects freed by reference counting since leave the count.
    assert 0.9 * frozen <= samples[("pdserve_gc_frozen_objects", base)] <= frozen
    full = tuple(sorted((labels | {"generation": "2"}).items()))
    assert samples[("pdserve_gc_collections_total", full)] == pauses.collections[2] >= 1
    assert samples[("pdserve_gc_full_pause_seconds_count", base)] == pauses.collections[2]
    assert samples[("pdserve_gc_pause_seconds_total", full)] == pytest.approx(pauses.seconds[2])
