"""The gather benchmark's CPU-side part: a clear refusal without a GPU and for bad flags."""

from __future__ import annotations

import pytest
import torch

from benchmarks.kv_gather import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs it for real")
def test_it_says_it_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--tokens", "64"])


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--held-layers", "0"], "--held-layers: 1 to 32"),
        (["--held-layers", "33"], "--held-layers: 1 to 32"),
        (["--layers", "0"], "--layers: at least 1"),
    ],
)
def test_bad_flags_are_refused_before_any_gpu_work(flags, says):
    with pytest.raises(SystemExit, match=says):
        main(flags)
