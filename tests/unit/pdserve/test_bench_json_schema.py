"""`pdserve bench serve --dataset json-schema`: requests carrying a JSON schema,
sent as OpenAI's response_format (pdserve's HTTP edge and vLLM take the same
body) or as gRPC's StructuredOutputs.json_schema."""

from __future__ import annotations

import argparse
import json

import jsonschema
import pydantic
import pytest
from openai.types.shared_params import ResponseFormatJSONSchema

from engine.structured import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS
from engine.structured.json_schema import check_schema
from pdserve.bench.backends import OpenAIBackend, SamplingOptions, grpc_request
from pdserve.bench.cli import add_serve_arguments, build_dataset, json_outputs
from pdserve.bench.datasets import DatasetKind, PromptFormat, json_schema_requests
from router.http.schemas import CompletionRequest


def requests(**kw):
    args = dict(n=10, input_len=32, output_len=200, vocab=1000, seed=3, schemas=4) | kw
    return json_schema_requests(**args)


def test_the_schemas_are_distinct_valid_and_pass_the_routers_check():
    reqs = requests()
    assert [len(r.prompt) for r in reqs] == [32] * 10 and all(r.output_len == 200 for r in reqs)
    schemas = [r.json_schema for r in reqs]
    assert schemas[:4] == schemas[4:8]  # sent in turn
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 4  # each a grammar of its own
    for schema in schemas[:4]:
        jsonschema.validators.validator_for(schema).check_schema(schema)
        check_schema(schema, "response_format", MAX_SPEC_CHARS, MAX_SCHEMA_DEPTH)
        # Nested, and bounded everywhere the output could run on.
        assert schema["properties"]["address"]["type"] == "object"
        assert schema["properties"]["tags"]["maxItems"] == 4
    assert requests() == reqs and requests(seed=4) != reqs  # seeded
    # Text prompts open with their schema, as an instruction.
    text = requests(n=1, fmt=PromptFormat.TEXT)[0]
    head, words = text.prompt.split("\n")
    assert json.dumps(text.json_schema) in head and len(words.split()) == 32


def test_the_openai_body_is_openais_response_format_which_pdserve_enforces():
    (req,) = requests(n=1)
    body = OpenAIBackend("http://127.0.0.1:1", SamplingOptions(ignore_eos=False)).body(req)
    fmt = body["response_format"]
    # The openai package's own type of a json_schema response_format (what vLLM parses too).
    pydantic.TypeAdapter(ResponseFormatJSONSchema).validate_python(fmt)
    assert fmt["json_schema"]["schema"] == req.json_schema and "ignore_eos" not in body
    (generate,) = CompletionRequest.model_validate(body).to_generate()
    assert json.loads(generate.sampling.structured_outputs.json_schema) == req.json_schema
    assert list(generate.token_ids.ids) == req.prompt and generate.sampling.max_tokens == 200
    grpc = grpc_request(req, SamplingOptions(ignore_eos=False))
    assert grpc.sampling.structured_outputs == generate.sampling.structured_outputs


def test_the_cli_builds_it_refuses_ignore_eos_and_counts_parsed_outputs():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)  # `pdserve bench serve`'s own arguments
    base = ["--dataset", "json-schema", "--num-prompts", "6", "--random-input-len", "16"]
    args = parser.parse_args([*base, "--json-schema-count", "2", "--vocab-size", "5000"])
    dataset = build_dataset(args, seed=0)
    assert dataset.kind is DatasetKind.JSON_SCHEMA and len(dataset.requests) == 6
    assert len({json.dumps(r.json_schema) for r in dataset.requests}) == 2
    with pytest.raises(ValueError, match="--ignore-eos"):
        build_dataset(parser.parse_args([*base, "--ignore-eos"]), seed=0)

    class Result:
        def __init__(self, success, text):
            self.success, self.text = success, text

    results = [Result(True, '{"a": 1}'), Result(True, '{"a": '), Result(False, "{}"),
               Result(True, "[1]")]  # fmt: skip
    assert json_outputs(results) == {"succeeded": 3, "parsed": 1}
