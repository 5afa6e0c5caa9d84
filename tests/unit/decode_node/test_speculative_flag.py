"""--speculative-config on decode nodes and `pdserve up`: vLLM's JSON form,
checked when the flags are read (before any model loads or node starts)."""

from __future__ import annotations

import argparse

import pytest

from decode_node.main import add_arguments
from pdserve import cli


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve decode")
    add_arguments(p)
    return p


def test_decode_node_takes_the_json_form(monkeypatch):
    monkeypatch.delenv("PDSERVE_SPECULATIVE_CONFIG", raising=False)
    assert parser().parse_args([]).speculative_config is None
    args = parser().parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert args.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 5,
    }
    monkeypatch.setenv("PDSERVE_SPECULATIVE_CONFIG", '{"speculative_model": "[ngram]", '
                       '"num_speculative_tokens": 2, "ngram_prompt_lookup_max": 2}')  # fmt: skip
    assert parser().parse_args([]).speculative_config["prompt_lookup_max"] == 2


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("{not json", "not JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be in"),
    ],
)
def test_bad_values_are_refused_before_start(monkeypatch, capsys, value, reason):
    monkeypatch.delenv("PDSERVE_SPECULATIVE_CONFIG", raising=False)
    with pytest.raises(SystemExit):
        parser().parse_args(["--speculative-config", value])
    assert reason in capsys.readouterr().err
    # `pdserve up` refuses it before it starts anything.
    code = cli.main(["up", "--model", "/nonexistent", "--speculative-config", value])
    assert code != 0
    assert reason in capsys.readouterr().err
