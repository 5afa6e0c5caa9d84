"""A node's LoRA adapters by name: the LoRARequest a request's adapter
reference resolves to, and the refusals (pure: no engine)."""

from __future__ import annotations

import grpc
import pytest

from common.cluster.state import lora_adapters_json
from common.grpc_server import status_of
from common.runtime.node_lora import AdapterRefused, NodeAdapters
from engine.lora.request import LoRARequest
from proto import internal_pb2

SQL = LoRARequest("sql", 1, "/adapters/sql")


def adapters() -> NodeAdapters:
    return NodeAdapters({"sql": (SQL, "aa")})


def test_base_and_known_adapter():
    assert adapters().request_of(internal_pb2.LoRAAdapterRef(), "d0") is None
    ref = internal_pb2.LoRAAdapterRef(name="sql", digest="aa")
    assert adapters().request_of(ref, "d0") is SQL
    assert lora_adapters_json(adapters().digests()) == '{"sql":"aa"}'


@pytest.mark.parametrize(
    ("name", "digest", "code", "words"),
    [
        ("chat", "aa", grpc.StatusCode.NOT_FOUND, "node d0 has no LoRA adapter 'chat'"),
        ("sql", "bb", grpc.StatusCode.FAILED_PRECONDITION, "has digest aa, not bb"),
    ],
)
def test_refusals_carry_their_status(name, digest, code, words):
    ref = internal_pb2.LoRAAdapterRef(name=name, digest=digest)
    with pytest.raises(AdapterRefused) as info:
        adapters().request_of(ref, "d0")
    got, message = status_of(info.value)
    assert got == code and words in message
