"""Structured outputs end to end on the demo model (real tokenizer, CPU).

Every JSON output parses and validates against its schema (the ``jsonschema``
package, formats checked); regex, choice and json_object outputs match; async
scheduling gives what the synchronous engine gives; the decode node's commit
and a migrated stream's replay continue the grammar where it was; bad input is
a ValueError before any state, a grammar that cannot compile ends its request
alone; no matcher outlives its request. One engine for the module.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest

from engine import LLM, SamplingParams
from engine.sampling_params import RequestOutputKind
from engine.sampling_params import StructuredOutputsParams as S
from tests.engine.conftest import assert_idle

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

PROMPT = "Reply with JSON only."
# Every output is bounded (strings by maxLength, arrays by maxItems, no free
# numbers, whose digits are not) so that each request ends within max_tokens.
INT = {"type": "integer", "minimum": 0, "maximum": 9}
WORD = {"type": "string", "maxLength": 6}
SCHEMAS = [
    {"type": "object", "properties": {"name": WORD, "age": INT}, "required": ["name", "age"]},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": INT, "ok": {"type": "boolean"}},
                "required": ["id", "ok"],
            }
        },
        "required": ["user"],
    },
    {"type": "array", "items": INT, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 1},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "v": {"const": 1}},
        "required": ["color", "v"],
    },
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]{3}$"}},
        "required": ["code"],
    },
    {"type": "string", "format": "date"},
    {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}},
        "required": ["when"],
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}},
        "required": ["ok", "n"],
    },
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
    {"type": "string", "enum": ["a b", "c"]},
    {"anyOf": [INT, {"type": "string", "maxLength": 4}]},
    {
        "oneOf": [
            {"type": "object", "properties": {"a": INT}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ]
    },
    {
        "$defs": {"pt": {"type": "object", "properties": {"x": INT}, "required": ["x"]}},
        "$ref": "#/$defs/pt",
    },
    {
        "definitions": {"c": {"enum": ["x", "y"]}},
        "type": "array",
        "items": {"$ref": "#/definitions/c"},
        "minItems": 1,
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {"a": INT, "b": {"type": "string", "maxLength": 4}},
        "required": ["a"],
    },
    {"type": "object", "properties": {"flag": {"type": "boolean"}}},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {"type": "boolean"},
    {"type": "null"},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 3}},
            "required": ["k"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {"type": "array", "prefixItems": [INT, {"type": "boolean"}], "items": False},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {
        "type": "object",
        "properties": {"id": INT},
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "array", "items": INT, "minItems": 1, "maxItems": 2},
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "title": "T",
        "description": "a small count",
        "type": "integer",
        "minimum": 0,
        "maximum": 3,
        "default": 1,
    },
    {"allOf": [{"type": "integer", "minimum": 0, "maximum": 3}]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": WORD, "maxItems": 2}},
        "required": ["tags"],
    },
]


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    llm = LLM(str(demo_model_dir), max_model_len=512, device="cpu", max_num_seqs=80)
    llm.llm_engine.structured.warm_up()  # xgrammar imported while the first test builds
    return llm


def _check_json(text: str, schema) -> None:
    instance = json.loads(text)
    jsonschema.validate(instance, schema, format_checker=jsonschema.FormatChecker())


def _idle(llm) -> None:
    assert_idle(llm)
    assert llm.llm_engine.num_grammar_matchers == 0
    assert len(llm.llm_engine.model_runner.sampling_rows) == 0


def test_json_schemas_greedy_and_seeded(llm):
    assert len(SCHEMAS) >= 30
    params = [
        SamplingParams(
            temperature=t,
            seed=i if t else None,
            max_tokens=32,
            structured_outputs=S(json=schema, disable_any_whitespace=True),
        )
        for t in (0.0, 1.0)
        for i, schema in enumerate(SCHEMAS)
    ]
    # One schema as JSON text, whitespace allowed: both forms are served.
    params[0] = SamplingParams(
        temperature=0, max_tokens=32, structured_outputs=S(json=json.dumps(SCHEMAS[0]))
    )
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        c = out.outputs[0]
        schema = SCHEMAS[i % len(SCHEMAS)]
        assert c.finish_reason == "stop", (schema, c.text)
        _check_json(c.text, schema)
    _idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_regex_choice_json_object(llm, async_scheduling):
    engine = llm.llm_engine
    engine.async_scheduling = async_scheduling  # read at each step; the engine is idle
    try:
        outs = llm.generate(
            ["My email is", "Is the sky blue?", "A JSON object:", "Tell me a story.", "Code:"],
            [
                SamplingParams(
                    temperature=0,
                    max_tokens=24,
                    structured_outputs=S(regex=r"[a-z]{2,8}@[a-z]{2,6}\.com"),
                ),
                SamplingParams(
                    temperature=0, max_tokens=8, structured_outputs=S(choice=["yes", "no", "maybe"])
                ),
                SamplingParams(
                    temperature=0,
                    max_tokens=16,
                    structured_outputs=S(json_object=True, disable_any_whitespace=True),
                ),
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                SamplingParams(
                    temperature=1.0,
                    seed=7,
                    max_tokens=8,
                    structured_outputs=S(regex=r"[A-Z][0-9]{4}"),
                ),
            ],
            use_tqdm=False,
        )
    finally:
        engine.async_scheduling = False
    email, choice, obj, free, code = (o.outputs[0] for o in outs)
    assert re.fullmatch(r"[a-z]{2,8}@[a-z]{2,6}\.com", email.text) and email.finish_reason == "stop"
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)
    assert len(free.token_ids) == 8 and free.finish_reason == "length"
    assert re.fullmatch(r"[A-Z][0-9]{4}", code.text)
    _idle(llm)
    # Async scheduling defers a structured step's sampling behind the previous
    # step's read: the tokens are exactly the synchronous engine's.
    key = tuple((c.token_ids, c.finish_reason) for c in (email, choice, obj, free, code))
    _RESULTS[async_scheduling] = key
    if len(_RESULTS) == 2:
        assert _RESULTS[False] == _RESULTS[True]


_RESULTS: dict[bool, tuple] = {}


def test_grammar_end_stops_and_max_tokens_gives_length(llm):
    schema = {
        "type": "object",
        "properties": {"name": WORD, "age": INT},
        "required": ["name", "age"],
    }
    short, choice = llm.generate(
        [PROMPT, "Pick one:"],
        [
            SamplingParams(temperature=0, max_tokens=3, structured_outputs=S(json=schema)),
            SamplingParams(
                temperature=0,
                max_tokens=20,
                ignore_eos=True,
                structured_outputs=S(choice=["alpha", "beta"]),
            ),
        ],
        use_tqdm=False,
    )
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3
    assert short.outputs[0].text.startswith("{")
    # ignore_eos does not run past the grammar's end.
    assert choice.outputs[0].text in ("alpha", "beta") and choice.outputs[0].finish_reason == "stop"
    _idle(llm)


def test_commit_and_replay_continue_the_grammar(llm, demo_tokenizer):
    """Disaggregated: the prefill node samples the first token under the grammar
    (its one-token clone keeps the spec) and the decode node's matcher takes
    that token at commit. Migrated: the tokens so far end the new prompt and are
    replayed into a fresh matcher (resume_offset). Both give the single node's
    tokens exactly."""
    engine = llm.llm_engine
    schema = SCHEMAS[1]  # a nested object: the replay resumes inside it
    params = SamplingParams(
        temperature=0,
        max_tokens=24,
        output_kind=RequestOutputKind.FINAL_ONLY,
        structured_outputs=S(json=schema, disable_any_whitespace=True),
    )
    ids = demo_tokenizer.encode("Two points as JSON:")
    (single,) = llm.generate([ids], params, use_tqdm=False)
    tokens = single.outputs[0].token_ids
    _check_json(single.outputs[0].text, schema)

    res = engine.reserve_request("decode", ids, params)
    engine.add_request("prefill", ids, params.clone(max_tokens=1, detokenize=False), hold_kv=True)
    first = _run_until(engine, "prefill").outputs[0].token_ids[0]
    assert first == tokens[0]
    held = engine.take_held("prefill")
    data = engine.model_runner.gather_kv(held.block_table[res.first_block :])
    engine.model_runner.scatter_kv(res.blocks_to_fill, data)
    engine.release_held("prefill")
    engine.commit_request("decode", first)
    assert _run_until(engine, "decode").outputs[0].token_ids == tokens

    k = len(tokens) // 2
    resumed = params.clone(max_tokens=24 - k, resume_offset=k)
    (rest,) = llm.generate([ids + tokens[:k]], resumed, use_tqdm=False)
    assert tokens[:k] + rest.outputs[0].token_ids == tokens
    _idle(llm)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (S(json='{"type": "object", "properties": '), "structured_outputs.json is not valid JSON"),
        (
            S(json={"type": "array", "uniqueItems": True}),
            "unsupported schema feature 'uniqueItems'",
        ),
        (S(regex="[a-"), "structured_outputs.regex is not a valid regex"),
        (S(regex="(?=x)y"), "lookaround"),
        (S(grammar="root ::= missing"), "rule 'missing' is not defined"),
        (S(choice=["x" * 70000]), "too large to compile"),
    ],
)
def test_bad_specs_are_refused_before_any_state(llm, spec, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", PROMPT, SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match=message):
        engine.reserve_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished_requests()
    _idle(llm)


def test_a_grammar_that_fails_to_compile_ends_its_request_alone(llm):
    # Passes the checks, but xgrammar's strict objects cannot have a property.
    bad = S(json={"type": "object", "minProperties": 1})
    outs = llm.generate(
        [PROMPT, PROMPT],
        [SamplingParams(structured_outputs=bad), SamplingParams(temperature=0, max_tokens=4)],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "abort"
    assert "structured_outputs.json could not be compiled" in outs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and outs[1].error is None
    _idle(llm)


def test_compiling_never_blocks_others_and_times_out(llm, monkeypatch):
    engine = llm.llm_engine
    manager = engine.structured._manager()
    never: Future = Future()
    monkeypatch.setattr(manager.compiler, "submit", lambda so: never)
    monkeypatch.setattr(manager, "compile_timeout_s", 3600.0)
    spec = S(regex="[0-9]+")
    engine.add_request("slow", PROMPT, SamplingParams(structured_outputs=spec))
    engine.add_request("free", PROMPT, SamplingParams(temperature=0, max_tokens=3))
    free = _run_until(engine, "free")
    assert free.outputs[0].finish_reason == "length"
    assert engine.requests["slow"].seqs[0].awaiting_grammar  # still queued behind its compile
    engine.abort_request("slow")  # a compiling request aborts like any other
    monkeypatch.setattr(manager, "compile_timeout_s", 0.0)
    engine.add_request("late", PROMPT, SamplingParams(structured_outputs=spec))
    late = _run_until(engine, "late")
    assert late.outputs[0].finish_reason == "abort"
    assert "did not compile within 0 s (compile_timeout_s)" in late.error
    _idle(llm)


def _run_until(engine, request_id):
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_a_token_the_grammar_rejects_ends_the_request_without_a_crash(llm, demo_tokenizer):
    # allowed_token_ids leaves only a token the grammar forbids.
    digit = demo_tokenizer.encode("7")[0]
    (out,) = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0,
            max_tokens=5,
            allowed_token_ids=[digit],
            structured_outputs=S(choice=["yes", "no"]),
        ),
        use_tqdm=False,
    )
    assert out.outputs[0].finish_reason == "abort"
    assert "not allowed by the grammar" in out.error
    _idle(llm)


def test_compiled_grammars_are_cached(llm):
    """One compile, then cache hits; the engine's stats (the nodes' metrics) say so."""
    manager = llm.llm_engine.structured._manager()
    spec = S(regex="[a-c]{3}")
    before = manager.compiler.num_compiles
    stats = llm.llm_engine.stats().grammar
    for _ in range(2):
        llm.generate(
            [PROMPT],
            SamplingParams(temperature=0, max_tokens=5, structured_outputs=spec),
            use_tqdm=False,
        )
    assert manager.compiler.num_compiles == before + 1 and manager.compiler.cached(spec)
    after = llm.llm_engine.stats().grammar
    assert after.cache_misses == stats.cache_misses + 1
    assert after.cache_hits == stats.cache_hits + 1
    # The compile's time is in the histogram: one more count, a positive sum.
    assert after.buckets[-1][1] == stats.buckets[-1][1] + 1 == after.cache_misses
    assert after.sum > stats.sum and after.num_matchers == 0
