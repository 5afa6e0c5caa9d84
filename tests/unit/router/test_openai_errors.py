"""The OpenAI edge's errors (router/http/errors.py, app.py): OpenAI's four
fields always, OpenAI's codes (never a gRPC status name), before and after
a stream began."""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
import pytest
from fastapi.testclient import TestClient

from proto import pdserve_pb2
from router.http.app import HttpStats, build_app
from router.service import RequestFailed

GRPC_NAMES = {c.name for c in grpc.StatusCode}


class FakeServicer:
    """generate: refuses with ``refusal`` at once, or fails after one token."""

    def __init__(self, refusal: RequestFailed | None = None) -> None:
        self.frontend = SimpleNamespace(model_id="m", tokenizer=None, max_model_len=64)
        self.routing = SimpleNamespace(read_nodes=self.read_nodes)
        self.refusal = refusal

    async def read_nodes(self) -> None:
        pass

    async def generate(self, request, timeout, traceparent=""):
        if self.refusal is not None:
            raise self.refusal
        response = pdserve_pb2.GenerateResponse()
        response.deltas.add(index=0, text="a", token_ids=[5])
        yield response
        raise RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed")


def post(servicer, body) -> tuple[int, str]:
    with TestClient(build_app(servicer, None, HttpStats())) as client:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reply = client.post("/v1/completions", content=data)
        return reply.status_code, reply.text


def error_of(text: str) -> dict:
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] not in GRPC_NAMES
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [(b"{not json", None), ({"prompt": {"a": 1}}, "prompt"),
     ({"prompt": "x", "guided_regex": 5}, "guided_regex")],
)  # fmt: skip
def test_bodies_pdserve_refuses_are_400_with_openais_fields(body, param):
    status, text = post(FakeServicer(), body)
    assert status == 400, text
    assert error_of(text)["param"] == param
    # An empty value asks for nothing: past the edge (the stand-in's deadline: 504).
    assert post(FakeServicer(), {"prompt": "x", "guided_json": {}})[0] == 504


def test_a_refusal_of_the_request_path_has_openais_code_and_the_field():
    refusal = RequestFailed(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1")
    status, text = post(FakeServicer(refusal), {"prompt": "x", "max_tokens": 0})
    error = error_of(text)
    assert status == 400 and error["code"] is None and error["param"] == "max_tokens"
    context = RequestFailed(
        grpc.StatusCode.INVALID_ARGUMENT, "prompt has 99 tokens but max_model_len is 64"
    )
    assert (
        error_of(post(FakeServicer(context), {"prompt": "x"})[1])["code"]
        == "context_length_exceeded"
    )
    busy = RequestFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "no capacity")
    assert error_of(post(FakeServicer(busy), {"prompt": "x"})[1])["code"] == "rate_limit_exceeded"


def test_a_failure_mid_stream_is_an_event_with_openais_four_fields():
    status, text = post(FakeServicer(), {"prompt": "x", "stream": True})
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    error = error_of(events[-2])
    assert error["type"] == "timeout" and error["param"] is None
