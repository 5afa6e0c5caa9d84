"""LoRA on the command line: the nodes' --enable-lora / --lora-modules (vLLM's
flags) and `pdserve up` passing them on."""

from __future__ import annotations

import argparse

import pytest

from common.runtime.config import NodeConfig, add_node_arguments
from engine.lora.request import LoRARequest
from pdserve import cli


def node_config(*flags: str) -> NodeConfig:
    parser = argparse.ArgumentParser()
    add_node_arguments(parser, default_port=50061)
    return NodeConfig.from_args(parser.parse_args(["--model", "/m", *flags]))


def test_lora_modules_become_requests_with_ids_in_order():
    node = node_config(
        "--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2"
    )
    assert node.lora_modules == (LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat"))
    assert node.engine["enable_lora"] is True and node.engine["max_loras"] == 2
    assert node_config().lora_modules == () and "enable_lora" not in node_config().engine


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--lora-modules", "sql=/a"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "sql"], "NAME=PATH"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "twice"),
    ],
)
def test_bad_lora_flags_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        node_config(*flags)


def test_pdserve_up_passes_the_adapters_to_every_node():
    parse = cli.build_parser().parse_args
    args = parse(["up", "--model", "/m", "--lora-modules", "a=/x", "--max-lora-rank", "32"])
    assert cli.lora_node_args(args) == [
        "--enable-lora", "--lora-modules", "a=/x", "--max-lora-rank", "32",
    ]  # fmt: skip
    assert cli.lora_node_args(parse(["up", "--model", "/m"])) == []
    with pytest.raises(ValueError, match="go with --enable-lora or --lora-modules"):
        cli.lora_node_args(parse(["up", "--model", "/m", "--max-loras", "2"]))
    # LoRA on with no adapter at start: they are loaded at run time (pdctl lora load).
    args = parse(["up", "--model", "/m", "--enable-lora", "--max-loras", "2"])
    assert cli.lora_node_args(args) == ["--enable-lora", "--max-loras", "2"]
