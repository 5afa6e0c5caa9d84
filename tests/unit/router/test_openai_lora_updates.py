"""vLLM's run-time LoRA endpoints on the OpenAI edge (router/http/lora_updates.py):
absent without the router's flag, the admin token's right required (loopback
only without a token), vLLM's plain-text successes and OpenAI error objects."""

from __future__ import annotations

import grpc
from fastapi.testclient import TestClient

from common.auth import StaticToken, TokenAuthInterceptor
from router.http.app import HttpStats, build_app
from router.lora_admin import LoRAUpdateFailed
from tests.unit.router.test_openai_errors import FakeServicer, error_of

TOKEN = "admin-token-0123456789"


class FakeLoRAAdmin:
    """Records the calls; ``refusal``: the LoRAUpdateFailed to raise."""

    def __init__(self, refusal: LoRAUpdateFailed | None = None) -> None:
        self.refusal = refusal
        self.calls: list[tuple] = []

    async def load(self, name: str, path: str):
        self.calls.append(("load", name, path))
        if self.refusal is not None:
            raise self.refusal

    async def unload(self, name: str):
        self.calls.append(("unload", name))
        if self.refusal is not None:
            raise self.refusal
        return None, 0


def client(lora=None, token: bool = True) -> TestClient:
    auth = TokenAuthInterceptor([StaticToken(TOKEN)]) if token else None
    updates = (lora, auth) if lora is not None else None
    return TestClient(build_app(FakeServicer(), None, HttpStats(), lora_updates=updates))


def post(c: TestClient, path: str, body: dict, token: str | None = TOKEN):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return c.post(path, json=body, headers=headers)


BODY = {"lora_name": "sql", "lora_path": "/adapters/sql"}


def test_without_the_flag_the_endpoints_do_not_exist():
    with client() as c:
        assert post(c, "/v1/load_lora_adapter", BODY).status_code == 404


def test_load_and_unload_answer_as_vllm_does():
    lora = FakeLoRAAdmin()
    with client(lora) as c:
        reply = post(c, "/v1/load_lora_adapter", {**BODY, "extra": 1})
        assert reply.status_code == 200
        assert reply.text == "Success: LoRA adapter 'sql' added successfully."
        reply = post(c, "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert reply.text == "Success: LoRA adapter 'sql' removed successfully."
        reply = post(c, "/v1/load_lora_adapter", {**BODY, "load_inplace": True})
        assert reply.status_code == 400 and error_of(reply.text)["param"] == "load_inplace"
        reply = post(c, "/v1/load_lora_adapter", {"lora_name": "sql"})
        assert reply.status_code == 400 and "lora_path" in error_of(reply.text)["message"]
    assert lora.calls == [("load", "sql", "/adapters/sql"), ("unload", "sql")]


def test_refusals_are_openai_errors_with_vllms_statuses():
    cases = [
        (grpc.StatusCode.ALREADY_EXISTS, 400, "invalid_request_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
    ]
    for code, status, kind in cases:
        refusal = LoRAUpdateFailed(code, "failed on d0: the reason")
        with client(FakeLoRAAdmin(refusal)) as c:
            reply = post(c, "/v1/load_lora_adapter", BODY)
            error = error_of(reply.text)
            assert (reply.status_code, error["type"]) == (status, kind), code
            assert error["message"] == "failed on d0: the reason"


def test_the_admin_token_is_required_and_without_one_only_loopback():
    lora = FakeLoRAAdmin()
    with client(lora) as c:
        assert post(c, "/v1/load_lora_adapter", BODY, token=None).status_code == 401
        assert post(c, "/v1/unload_lora_adapter", BODY, token="x" * 20).status_code == 401
    with client(lora, token=False) as c:  # TestClient's peer is not a loopback address
        reply = post(c, "/v1/load_lora_adapter", BODY, token=None)
        assert reply.status_code == 403 and "router's host only" in error_of(reply.text)["message"]
    assert lora.calls == []
