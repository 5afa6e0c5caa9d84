"""`pdctl lora list|load|unload` against a stub admin API: what each sends, prints
and returns (text and --json)."""

from __future__ import annotations

import json

from proto import admin_pb2
from router.admin import pdctl

SQL = admin_pb2.LoRAAdapter(
    name="sql", digest="ab12", node_ids=["d0", "p0"], resident_node_ids=["d0"]
)


class Stub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object, dict]] = []

    def ListLoRAAdapters(self, request, **call):
        self.calls.append(("list", request, call))
        return admin_pb2.ListLoRAAdaptersResponse(adapters=[SQL])

    def LoadLoRAAdapter(self, request, **call):
        self.calls.append(("load", request, call))
        return admin_pb2.LoRAAdapterResponse(adapter=SQL)

    def UnloadLoRAAdapter(self, request, **call):
        self.calls.append(("unload", request, call))
        return admin_pb2.LoRAAdapterResponse(adapter=SQL, requests_in_flight=3)


def run(argv: list[str], capsys) -> tuple[Stub, str]:
    args = pdctl.build_parser().parse_args(argv)
    args.call = {"timeout": args.timeout}
    stub = Stub()
    assert args.func(stub, args) == 0
    return stub, capsys.readouterr().out


def test_list_shows_each_adapter_and_where_it_is(capsys):
    _, out = run(["lora", "list"], capsys)
    assert out.split("\n")[1].split() == ["sql", "ab12", "d0,p0", "d0"]
    _, out = run(["lora", "list", "--json"], capsys)
    assert json.loads(out) == [
        {"name": "sql", "digest": "ab12", "node_ids": ["d0", "p0"], "resident_node_ids": ["d0"]}
    ]


def test_load_and_unload_send_the_name_and_path(capsys):
    stub, out = run(["--timeout", "5", "lora", "load", "sql", "/adapters/sql"], capsys)
    _, request, call = stub.calls[0]
    assert (request.lora_name, request.lora_path) == ("sql", "/adapters/sql")
    assert call["timeout"] == pdctl.LOAD_TIMEOUT_S  # a load reads files on every node
    assert out == "LoRA adapter 'sql' loaded on d0, p0 (digest ab12)\n"
    stub, out = run(["lora", "unload", "sql", "--json"], capsys)
    assert stub.calls[0][1].lora_name == "sql" and stub.calls[0][2]["timeout"] == 10.0
    assert json.loads(out)["requests_in_flight"] == 3
