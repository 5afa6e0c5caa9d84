"""`pdserve bench serve --lora-modules A B C`: requests name the adapters in turn,
in the OpenAI body's model field and gRPC's."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from pdserve.bench.backends import OpenAIBackend, SamplingOptions, grpc_request
from pdserve.bench.cli import add_serve_arguments, build_dataset
from router.http.schemas import CompletionRequest


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--num-prompts", "10", "--vocab-size", "5000", *argv])


def test_each_adapter_equally_often_in_both_bodies():
    args = parse("--lora-modules", "a", "b", "c", "--model", "base")
    reqs = build_dataset(args, seed=0).requests
    assert [r.model for r in reqs] == ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a"]
    assert Counter(r.model for r in reqs[:9]) == {"a": 3, "b": 3, "c": 3}
    backend = OpenAIBackend("http://127.0.0.1:1", SamplingOptions(model="base"))
    for req in reqs[:3]:
        body = backend.body(req)
        assert body["model"] == req.model
        assert CompletionRequest.model_validate(body).model == req.model  # the edge routes by it
        assert grpc_request(req, SamplingOptions()).model == req.model
    # Without the option every request names --model, as before.
    plain = build_dataset(parse("--model", "base"), seed=0).requests
    assert all(backend.body(r)["model"] == "base" for r in plain)
    assert all(grpc_request(r, SamplingOptions()).model == "" for r in plain)


def test_multi_turn_is_refused():
    with pytest.raises(ValueError, match="multi-turn"):
        build_dataset(parse("--dataset", "multi-turn", "--lora-modules", "a", "b"), seed=0)
