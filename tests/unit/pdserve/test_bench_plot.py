"""`pdserve bench plot`: the throughput axis says per GPU only for runs on GPUs
(pdserve/bench/plot.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure

from pdserve.bench.plot import plot_records


def record(device: str | None, num_gpus: int = 1) -> dict:
    rate = {
        "request_rate": 1.0, "request_throughput": 1.0, "output_throughput": 80.0,
        "output_tokens_per_s_per_user": 20.0, "ttft_ms": {"p90": 50.0}, "tpot_ms": {"p90": 9.0},
    }  # fmt: skip
    return {
        "label": "pdserve", "dataset": "random", "environment": {"server_device": device},
        "parameters": {"num_gpus": num_gpus}, "rates": [rate],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("devices", "label", "y"),
    [
        ([None], "output tok/s", 80.0),  # a CPU host: the generator saw no GPU
        (["NVIDIA H200"], "output tok/s per GPU", 40.0),
        ([None, "2 x NVIDIA H200"], "output tok/s per GPU (runs on no GPU: total)", None),
    ],
)
def test_the_throughput_axis_names_what_it_shows(tmp_path, monkeypatch, devices, label, y):
    seen = {}

    def savefig(fig, *args, **kwargs):
        axis = fig.axes[2]
        seen["label"] = axis.get_ylabel()
        seen["y"] = [float(v) for line in axis.get_lines() for v in line.get_ydata()]

    monkeypatch.setattr(Figure, "savefig", savefig)
    plot_records([record(d, num_gpus=2) for d in devices], tmp_path / "p.png")
    assert seen["label"] == label
    if y is not None:
        assert seen["y"] == [y]
