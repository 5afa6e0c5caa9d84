"""benchmarks/http_overhead.py: the HTTP edge's in-process cost, as a record."""

from __future__ import annotations

import json

import pytest


def test_the_edge_cost_is_recorded_with_its_device(tmp_path):
    pytest.importorskip("fastapi")
    from benchmarks import http_overhead

    record = http_overhead.main(["--edge-only", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("http_overhead-*.json")
    assert json.loads(path.read_text()) == record
    edge = record["results"]["edge_cpu"]
    assert edge["parse_us"] > 0 and edge["sse_chunk_us"] > 0
    assert record["environment"]["device"]  # "cpu (MODEL)" here
    assert record["command"].startswith("python benchmarks/http_overhead.py --edge-only")
