"""The two-GPU send benchmarks' CPU-side parts: the chunking they send, and a clear refusal here."""

from __future__ import annotations

import pytest

from benchmarks.kv_send_paths import chunk_layers, main, nccl_messages, variants
from benchmarks.kv_stream_worker import geometry


@pytest.mark.parametrize(
    ("lpc", "last", "expected"),
    [
        (1, 0, [(n, n + 1) for n in range(32)]),
        (4, 0, [(n, n + 4) for n in range(0, 32, 4)]),
        (32, 0, [(0, 32)]),
        (1, 4, [(0, 28), (28, 29), (29, 30), (30, 31), (31, 32)]),
        (3, 7, [(0, 25), (25, 28), (28, 31), (31, 32)]),
        (32, 4, [(0, 32)]),  # one chunk already: nothing to hold
        (1, 32, [(n, n + 1) for n in range(32)]),  # every layer "last"
    ],
)
def test_chunks_are_the_streamers_cut_of_the_layers(lpc, last, expected):
    assert chunk_layers(32, lpc, last) == expected


def test_nccl_messages_are_every_send_of_every_variant_in_order():
    g = geometry("llama-3.1-8b")
    a = {
        "tokens": "2048",
        "layers_per_chunk": "1,32",
        "last_layers": "0,4",
        "modes": ["none", "nccl", "ce"],
        "warmup": 1,
        "iters": 2,
        "block_size": 16,
        "num_layers": 32,
    }
    # (32, 4) would repeat (32, 0): left out.
    assert variants(a) == [(1, 0), (1, 4), (32, 0)]
    layer = 2 * 128 * 16 * 8 * 128 * 2  # one layer's K and V of 128 blocks, bf16
    per_variant = {
        (1, 0): [layer] * 32,
        (1, 4): [28 * layer] + [layer] * 4,
        (32, 0): [32 * layer],
    }
    expected = []
    for sizes in per_variant.values():
        expected += sizes * 3  # under the forward, 3 rounds (one NCCL way each)
        expected += (sizes + [32 * layer]) * 3  # back to back, then one message
    assert nccl_messages(a, g) == expected


def test_refuses_to_run_without_two_gpus():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the benchmark would run")
    with pytest.raises(SystemExit, match="needs two GPUs"):
        main(["--tokens", "512"])
