"""Structured outputs' parameters, configuration and validation: torch-free, with
errors that name the field and the reason (engine/structured/validate.py)."""

from __future__ import annotations

import json

import pytest

from engine.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from engine.structured import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, validate
from engine.structured.config import StructuredOutputsConfig
from engine.structured.validate import choice_grammar

S = StructuredOutputsParams


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice"):
        S()
    with pytest.raises(ValueError, match="got json, regex"):
        S(json={"type": "integer"}, regex="a+")
    assert S(json_object=True).kind == "json_object"
    assert S(json={"type": "integer"}, json_object=False).kind == "json"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regex": 5}, "structured_outputs.regex must be a string"),
        ({"grammar": ["x"]}, "structured_outputs.grammar must be a string"),
        ({"json": 3.5}, "structured_outputs.json must be a JSON schema"),
        ({"choice": "yes"}, "structured_outputs.choice must be a list of strings"),
        ({"choice": []}, "structured_outputs.choice must not be empty"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a list of strings"),
        ({"json_object": "yes"}, "structured_outputs.json_object must be a bool"),
        ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
    ],
)
def test_shape_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        S(**kwargs)


def test_guided_decoding_is_the_old_name():
    assert GuidedDecodingParams is StructuredOutputsParams
    p = SamplingParams(guided_decoding=GuidedDecodingParams(regex="[0-9]+"))
    assert p.structured_outputs.regex == "[0-9]+" and p.guided_decoding is None
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=S(regex="a"), guided_decoding=S(regex="b"))


def test_dict_spec_and_clone_keep_the_spec():
    p = SamplingParams(structured_outputs={"choice": ["yes", "no"]}, max_tokens=8)
    assert p.structured_outputs == S(choice=["yes", "no"])
    # The prefill node's one-token copy samples under the same grammar.
    one = p.clone(max_tokens=1)
    assert one.structured_outputs == p.structured_outputs and one.max_tokens == 1
    with pytest.raises(ValueError, match="unknown structured_outputs field"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="must be StructuredOutputsParams"):
        SamplingParams(structured_outputs=5)


def test_spec_key_is_canonical():
    a = S(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = S(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.key() == b.key()
    assert a.key() != S(json=a.json, disable_any_whitespace=True).key()


@pytest.mark.parametrize(
    "spec",
    [
        S(json={"type": "object", "properties": {"a": {"type": "string", "format": "date"}}}),
        S(json='{"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p"}'),
        S(json={"type": "integer", "multipleOf": 5}),
        S(json={"allOf": [{"type": "integer"}]}),
        S(json=True),
        S(json={"type": "array", "prefixItems": [{"type": "integer"}], "items": False}),
        S(json={"type": "object", "patternProperties": {"^a": {"type": "integer"}}}),
        S(regex=r"[a-z]+@[a-z]+\.(com|org)"),
        S(regex=r"\\b\\1[(?=]\++"),  # escaped: literals, not the constructs
        S(choice=["yes", 'say "no"', "a\\b\n"]),
        S(grammar='root ::= item ("," item)*\nitem ::= [a-z]+ # a word\n'),
        S(json_object=True),
        S(
            structural_tag='{"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}'
        ),
    ],
)
def test_valid_specs_pass(spec):
    validate(spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (S(json="{not json"), r"structured_outputs\.json is not valid JSON"),
        (S(json={"type": "strnig"}), r"'type' must be one of .* at #"),
        (
            S(json={"type": "array", "uniqueItems": True}),
            "unsupported schema feature 'uniqueItems'",
        ),
        (S(json={"properties": {"a": {"not": {}}}}), r"'not' \(negation\) at #/properties/a"),
        (S(json={"if": {}, "then": {}}), "unsupported schema feature 'if'"),
        (S(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}), "'allOf' of more than one"),
        (S(json={"type": "string", "format": "weird"}), "unsupported string format 'weird'"),
        (S(json={"type": "number", "multipleOf": 0.5}), "'multipleOf' is supported on integers"),
        (S(json={"$ref": "https://example.com/s.json"}), "only local references"),
        (S(json={"$ref": "#/$defs/missing"}), "points at nothing"),
        (
            S(json={"type": "array", "minItems": 3, "maxItems": 1}),
            "minItems 3 is greater than maxItems 1",
        ),
        (S(json={"type": "string", "pattern": "(?=a)b"}), "pattern at #.* lookaround"),
        (S(json={"dependentRequired": {"a": ["b"]}}), "dependencies"),
        (S(json="[1, 2]"), "a schema must be an object or a boolean"),
        (S(regex="(unclosed"), r"structured_outputs\.regex is not a valid regex"),
        (S(regex=r"(a)\1"), "backreferences"),
        (S(regex=r"(?<=a)b"), "lookaround"),
        (S(regex=r"(?P<n>a)"), "named groups"),
        (S(regex=r"(?i)abc"), "inline flags"),
        (S(regex=r"\bword"), "word boundaries"),
        (S(regex=r"a++"), "possessive"),
        (S(regex=r"\Aabc"), "anchors"),
        (S(grammar='rot ::= "a"'), "has no 'root' rule"),
        (S(grammar="root ::= x"), "rule 'x' is not defined at line 1, column 10"),
        (S(grammar='root ::= "a" |'), "expected an element"),
        (S(grammar='root ::= "a"\nroot ::= "b"'), "defined twice at line 2"),
        (S(grammar='root ::= "unterminated'), "unterminated string"),
        (S(grammar='root ::= "\\q"'), "invalid escape"),
        (S(grammar="root ::= [z-a]"), "reversed"),
        (S(grammar='root ::= ("a"'), "expected '\\)'"),
        (S(choice=["a", ""]), "must not contain an empty string"),
        (S(structural_tag="[1]"), "structural_tag must be a JSON object"),
        (S(regex="a", whitespace_pattern=" *"), "whitespace_pattern is not supported"),
    ],
)
def test_bad_specs_name_the_field_and_reason(spec, message):
    with pytest.raises(ValueError, match=message) as e:
        validate(spec)
    assert str(e.value).startswith("structured_outputs.")


def test_size_bounds():
    with pytest.raises(ValueError, match="too large to compile"):
        validate(S(regex="a" * (MAX_SPEC_CHARS + 1)))
    with pytest.raises(ValueError, match="too large to compile"):
        validate(S(grammar='root ::= "' + "a" * MAX_SPEC_CHARS + '"'))
    big = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(5000)}}
    with pytest.raises(ValueError, match="too large to compile"):
        validate(S(json=big))
    with pytest.raises(ValueError, match=f"at most {MAX_CHOICES}"):
        validate(S(choice=[str(i) for i in range(MAX_CHOICES + 1)]))
    deep: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper"):
        validate(S(json=deep))


def test_choice_grammar_escapes():
    assert choice_grammar(["a", 'b"c']) == 'root ::= "a" | "b\\"c"'


def test_config_backends():
    assert StructuredOutputsConfig.parse(None, None).backend == "auto"
    assert StructuredOutputsConfig.parse({"backend": "xgrammar"}, None).backend == "xgrammar"
    assert StructuredOutputsConfig.parse(None, "xgrammar").backend == "xgrammar"
    with pytest.raises(ValueError, match="must be one of 'auto', 'xgrammar'; got 'outlines'"):
        StructuredOutputsConfig.parse(None, "outlines")
    with pytest.raises(ValueError, match="disagree"):
        StructuredOutputsConfig.parse({"backend": "auto"}, "xgrammar")
    with pytest.raises(ValueError, match="compile_timeout_s must be a positive number"):
        StructuredOutputsConfig(compile_timeout_s=0)
    with pytest.raises(ValueError, match="unknown structured_outputs_config field"):
        StructuredOutputsConfig.parse({"backnd": "x"}, None)


def test_engine_config_takes_vllm_names(tmp_path):
    from engine.config import EngineConfig
    from tests.conftest import TINY_CONFIGS, write_config_dir

    tiny_model_dir = write_config_dir(tmp_path / "m", TINY_CONFIGS["llama"])
    cfg = EngineConfig(str(tiny_model_dir), guided_decoding_backend="xgrammar")
    assert cfg.structured_outputs_config.backend == "xgrammar"
    again = EngineConfig.from_json(cfg.to_json())
    assert again.structured_outputs_config == cfg.structured_outputs_config
    with pytest.raises(ValueError, match="structured_outputs_config.backend must be one of"):
        EngineConfig(str(tiny_model_dir), structured_outputs_config={"backend": "guidance"})


def test_regex_and_grammar_checks_agree_with_xgrammar():
    """Where this checker accepts, xgrammar compiles; where it refuses, so would
    xgrammar (the cases a router must catch)."""
    xgr = pytest.importorskip("xgrammar")
    regexes = [
        r"[a-z]+",
        r"(?=a)b",
        r"(a)\1",
        r"(?P<n>a)",
        r"\d{2,3}",
        r"a{,3}",
        r"(",
        r"a*?",
        r"(?i)a",
        r"\bw",
        r"a++",
        r"[*+]+",
        r"\++",
        r"[z-a]",
        r"^ab$",
        r"\x41",
    ]
    grammars = [
        'root ::= "a" | "b"',
        "root ::= x",
        'rot ::= "a"',
        'root ::= "a" {2,3}',
        "root ::= (",
        "root ::= 'a'",
        'root ::= a\na ::= "x" | root',
        'root ::= "a" (= "b")',
        'root ::= "\\q"',
        "root ::= [\\]]",
        "root ::= [z-a]",
        'root ::= "a"**',
        "",
    ]
    for text, ours, theirs in [
        *((r, S(regex=r), xgr.Grammar.from_regex) for r in regexes),
        *((g, S(grammar=g), xgr.Grammar.from_ebnf) for g in grammars),
    ]:
        try:
            validate(ours)
            accepted = True
        except ValueError:
            accepted = False
        try:
            theirs(text)
            compiles = True
        except Exception:
            compiles = False
        assert accepted == compiles, text


def test_schema_checks_agree_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    schemas = [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "strnig"},
        {"$ref": "#/$defs/missing"},
        {"type": "string", "minLength": 3, "maxLength": 2},
        {"type": "array", "minItems": 3, "maxItems": 1},
        {"type": "string", "pattern": "(a)\\1"},
    ]
    for schema in schemas:
        try:
            validate(S(json=schema))
            accepted = True
        except ValueError:
            accepted = False
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema))
            compiles = True
        except Exception:
            compiles = False
        assert accepted == compiles, schema
