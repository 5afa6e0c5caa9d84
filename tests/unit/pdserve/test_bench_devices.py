"""What benchmark records name as their device (pdserve/bench/devices.py)."""

from __future__ import annotations

import os
import stat

from pdserve.bench import devices


def test_names_are_counted_per_model():
    assert devices.describe([]) is None
    assert devices.describe(["NVIDIA H200"]) == "NVIDIA H200"
    assert devices.describe(["NVIDIA H200"] * 2) == "2 x NVIDIA H200"
    assert devices.describe(["A", "B", "A"]) == "2 x A, B"


def test_the_cpu_has_a_name():
    assert devices.cpu_model().strip()


def fake_nvidia_smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that names two GPUs and writes down its arguments."""
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/args\necho "NVIDIA H200"\necho "NVIDIA H200"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "args"


def test_local_gpus_are_the_ones_cuda_would_see(tmp_path, monkeypatch):
    args = fake_nvidia_smi(tmp_path, monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.local_gpus() == ["NVIDIA H200", "NVIDIA H200"]
    assert "-i" not in args.read_text().split()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1, 3")
    devices.local_gpus()
    assert args.read_text().split()[-2:] == ["-i", "1,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.local_gpus() == []  # set and empty: no GPU


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.local_gpus() == []
    assert devices.server_device(None) is None
    assert devices.server_device("NVIDIA H200 (remote)") == "NVIDIA H200 (remote)"
