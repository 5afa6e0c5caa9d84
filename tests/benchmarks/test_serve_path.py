"""benchmarks/serve_path.py on the CPU, engine modes only (the node modes start a
cluster; the GPU runs in docs/performance.md use them): the random dataset, the
late-launch A/B modes on one engine, and the record they write."""

from __future__ import annotations

import json

from benchmarks import serve_path


def test_random_prompts_through_both_engine_modes(tmp_path):
    argv = "--modes engine engine-early --dataset random --input-len 24 --output-len 4"
    argv += " --num-prompts 6 --request-rate 20 --rounds 1 --device cpu --torch-threads 1"
    record = serve_path.main([*argv.split(), "--out", str(tmp_path)])
    written = json.loads(next(tmp_path.glob("serve_path-*.json")).read_text())
    assert written["results"]["summary"] == record["results"]["summary"]
    sweeps = record["results"]["sweeps"]
    assert [s["mode"] for s in sweeps] == ["engine", "engine-early"]
    for s in sweeps:
        assert s["completed"] == 6 and s["failed"] == 0
        assert s["ttft_ms"]["p50_ms"] > 0
        # The engine's step clock counted every launch; a CPU engine never holds one.
        late = s["late_launch"]
        assert late["num_launches"] >= 4 and late["num_late_launches"] == 0
    assert set(record["results"]["summary"]) == {"engine@20", "engine-early@20"}
