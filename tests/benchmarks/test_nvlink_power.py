"""nvlink_power.py's CPU-side parts: the nvidia-smi samples it reads, and a clear refusal here."""

from __future__ import annotations

import io
from datetime import datetime

import pytest

from benchmarks.nvlink_power import SmiSampler, main


def test_samples_are_parsed_and_a_phase_reads_its_medians(monkeypatch):
    monkeypatch.setattr("subprocess.Popen", _raise_oserror)
    smi = SmiSampler()  # no nvidia-smi: it samples nothing, and says so by its empty phases
    assert smi.proc is None and smi.between(0, 0, 1e12) == {}

    class FakeProc:
        stdout = io.StringIO(
            "0, 2026/11/27 13:15:00.100, 1485, 690.5\n"
            "1, 2026/11/27 13:15:00.100, 1980, 161.2\n"
            "0, 2026/11/27 13:15:00.200, 1470, 691.5\n"
            "0, 2026/11/27 13:15:00.300, [N/A], 691.0\n"  # skipped
            "0, 2026/11/27 13:15:09.000, 1980, 120.0\n"  # outside the phase
        )

    smi.proc = FakeProc()
    smi._read()
    t0 = datetime(2026, 11, 27, 13, 15, 0).timestamp()
    assert smi.between(0, t0, t0 + 1) == {"gpu0_sm_mhz": 1477.5, "gpu0_power_w": 691.0}
    assert smi.between(1, t0, t0 + 1) == {"gpu1_sm_mhz": 1980.0, "gpu1_power_w": 161.2}


def _raise_oserror(*args, **kwargs):
    raise OSError("no nvidia-smi")


def test_refuses_to_run_without_two_gpus():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the benchmark would run")
    with pytest.raises(SystemExit, match="needs two GPUs"):
        main(["--seconds", "1"])
