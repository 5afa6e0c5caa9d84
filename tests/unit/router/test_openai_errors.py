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
from router.models import resolve_model
from router.service import RequestFailed

GRPC_NAMES = {c.name for c in grpc.StatusCode}


class FakeServicer:
    """generate: refuses with ``refusal`` at once, or fails after one token."""

    def __init__(self, refusal: RequestFailed | None = None) -> None:
        self.frontend = SimpleNamespace(model_id="m", tokenizer=None, max_model_len=64)
        # One LoRA adapter registered (router/models.py resolves names against it).
        self.routing = SimpleNamespace(
            read_nodes=self.read_nodes, model=self.model, adapters={"sql": "aa"}
        )
        self.refusal = refusal
        self.models: list[str] = []  # the model field of each request generated

    async def read_nodes(self) -> None:
        pass

    async def model(self, name: str):
        return resolve_model(name, "m", self.routing.adapters)

    async def generate(self, request, timeout, traceparent="", prompt_ids=None):
        self.models.append(request.model)
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


def test_model_names_the_base_or_an_adapter_and_models_lists_adapters():
    servicer = FakeServicer()
    with TestClient(build_app(servicer, None, HttpStats())) as client:
        for model in ("sql", "m", None):
            body = {"prompt": "x", "stream": True} | ({"model": model} if model else {})
            reply = client.post("/v1/completions", json=body)  # streamed: chunks then an error
            assert reply.status_code == 200 and f'"model":"{model or "m"}"' in reply.text
        unknown = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        listed = client.get("/v1/models").json()["data"]
    assert servicer.models == ["sql", "m", ""]  # the adapter's name goes downstream
    assert unknown.status_code == 404
    error = error_of(unknown.text)
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found",
        "model",
        "not_found_error",
    )
    assert "'nope' does not exist (this server serves 'm', 'sql')" in error["message"]
    assert [(m["id"], m["parent"]) for m in listed] == [("m", None), ("sql", "m")]


def test_a_not_found_from_the_request_path_is_model_not_found():
    refusal = RequestFailed(grpc.StatusCode.NOT_FOUND, "the model 'sql' does not exist")
    status, text = post(FakeServicer(refusal), {"model": "sql", "prompt": "x"})
    assert status == 404 and error_of(text)["code"] == "model_not_found"
