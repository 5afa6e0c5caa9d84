"""The prefill node's KV-streaming flags: how a step's layers are cut, and what start-up refuses."""

from __future__ import annotations

import argparse

import pytest

from common.kv_transfer.protocol import MAX_GROUP
from prefill_node.kv_stream import layer_spans
from prefill_node.main import add_arguments, check_group_room


@pytest.mark.parametrize(
    ("layers", "per_chunk", "last", "spans"),
    [
        (32, 1, 0, [(0, 32, 1)]),
        (32, 1, 4, [(0, 28, 28), (28, 32, 1)]),
        (32, 2, 5, [(0, 27, 27), (27, 32, 2)]),
        (32, 32, 4, [(0, 32, 32)]),  # one chunk already
        (32, 1, 32, [(0, 32, 1)]),  # nothing left to hold
        (32, 1, 40, [(0, 32, 1)]),
    ],
)
def test_layer_spans(layers, per_chunk, last, spans):
    assert layer_spans(layers, per_chunk, last) == spans


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", "m", *argv])


def test_a_step_of_max_num_seqs_requests_fits_one_kv_group():
    check_group_room(parse("--max-num-seqs", str(MAX_GROUP)))
    check_group_room(parse("--max-num-seqs", str(MAX_GROUP // 2), "--kv-stream-last-layers", "4"))
    check_group_room(parse("--kv-stream-last-layers", "4"))  # the default max_num_seqs
    with pytest.raises(ValueError, match="lower --max-num-seqs$"):
        check_group_room(parse("--max-num-seqs", str(MAX_GROUP + 1)))
    with pytest.raises(ValueError, match="--kv-stream-last-layers 0"):
        check_group_room(
            parse("--max-num-seqs", str(MAX_GROUP // 2 + 1), "--kv-stream-last-layers", "4")
        )


def test_stream_flags_come_from_the_environment(monkeypatch):
    assert parse().kv_stream_last_layers == 0
    monkeypatch.setenv("PDSERVE_KV_STREAM_LAST_LAYERS", "4")
    assert parse().kv_stream_last_layers == 4
    assert parse("--kv-stream-last-layers", "2").kv_stream_last_layers == 2
