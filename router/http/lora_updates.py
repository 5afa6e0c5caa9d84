"""vLLM's run-time LoRA endpoints on the OpenAI API, behind the router's
``--allow-runtime-lora-updating`` (vLLM gates them with its environment
variable VLLM_ALLOW_RUNTIME_LORA_UPDATING; off, they do not exist: 404).

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}
    POST /v1/unload_lora_adapter  {"lora_name": ...}

As vLLM answers: 200 with a plain-text body ("Success: LoRA adapter 'NAME'
added successfully." / "... removed successfully."), else OpenAI's error
object: 400 for a name already loaded or an adapter the nodes cannot apply,
404 for no adapter at the path or an unknown name on unload. Both change what
every client sees, so they need the admin token (``--admin-token``, or a
tokens-file token with the admin right); a router with neither takes them
from its own host only, as its admin API does. The work is the admin API's
(router/lora_admin.py): every node, all or nothing.
"""

from __future__ import annotations

import ipaddress

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from router.http.errors import ApiError
from router.lora_admin import LoRAAdmin, LoRAUpdateFailed
from router.service import RequestFailed

# The admin API's method the token's right is checked against (common/auth.py).
LOAD_METHOD = "/pdserve.v1.Admin/LoadLoRAAdapter"


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body; ``load_inplace`` (replace a loaded adapter) is refused."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body; its ``lora_int_id`` is a per-engine id pdserve does not expose."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str


def add_lora_routes(app: FastAPI, lora: LoRAAdmin, admin_auth, parse) -> None:
    """``admin_auth``: the admin API's TokenAuthInterceptor, or None;
    ``parse``: the app's body parser (invalid bodies answered as OpenAI's)."""
    gate = [Depends(_AdminGate(admin_auth))]

    async def load(request: Request):
        body = await parse(request, LoadLoRAAdapterRequest)
        if body.load_inplace:
            raise ApiError(
                400, "load_inplace is not supported: unload the adapter, then load it",
                "invalid_request_error", "load_inplace",
            )  # fmt: skip
        await _answer(lora.load(body.lora_name, body.lora_path))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(request: Request):
        body = await parse(request, UnloadLoRAAdapterRequest)
        await _answer(lora.unload(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    app.post("/v1/load_lora_adapter", dependencies=gate)(load)
    app.post("/v1/unload_lora_adapter", dependencies=gate)(unload)


async def _answer(work):
    try:
        return await work
    except LoRAUpdateFailed as e:
        # A load refused because the name is taken is a 400, as vLLM's.
        code = (
            grpc.StatusCode.INVALID_ARGUMENT if e.code is grpc.StatusCode.ALREADY_EXISTS else e.code
        )
        raise ApiError.from_failure(RequestFailed(code, str(e))) from None


class _AdminGate:
    def __init__(self, auth) -> None:
        self.auth = auth

    async def __call__(self, request: Request) -> None:
        if self.auth is None:
            host = request.client.host if request.client else ""
            if not _loopback(host):
                raise ApiError(
                    403,
                    "run-time LoRA updates are taken from the router's host only when it has "
                    "no --admin-token",
                    "permission_error",
                )
            return
        header = request.headers.get("authorization")
        refusal = self.auth.check(LOAD_METHOD, [("authorization", header)] if header else [])
        if refusal is not None:
            raise ApiError.from_failure(RequestFailed(*refusal))


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
