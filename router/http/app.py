"""The OpenAI-compatible HTTP API (FastAPI on uvicorn), on the router's own asyncio loop.

A thin edge: JSON -> GenerateRequest (router/http/schemas.py), then the very
coroutine the gRPC Generate runs (RouterServicer.generate: validation, routing,
retries, relaying), then GenerateResponse -> OpenAI JSON or Server-Sent Events.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse
from prometheus_client.core import CounterMetricFamily
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.tls import TLSConfig
from common.tracing import TRACEPARENT_KEY
from proto import pdserve_pb2
from router.http.chunks import Assembler, EchoLogprobs
from router.http.errors import ApiError, invalid_body
from router.http.lora_updates import add_lora_routes
from router.http.response_output import ResponsesAssembler
from router.http.responses import ResponsesRequest, responses_param
from router.http.schemas import ChatCompletionRequest, CompletionRequest, InvalidField
from router.lora_admin import LoRAAdmin
from router.models import ModelNotFound
from router.service import RequestFailed, RouterServicer

GENERATE_METHOD = "/pdserve.v1.Router/Generate"  # the gRPC method whose right HTTP calls need
TIMEOUT_HEADER = "x-request-timeout"  # seconds; the gRPC deadline's counterpart (504 past it)


@dataclass(slots=True)
class HttpStats:
    """Requests by endpoint and HTTP status (pdserve_router_http_requests_total)."""

    by_endpoint_status: collections.Counter = field(default_factory=collections.Counter)


class HttpCollector:
    def __init__(self, stats: HttpStats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "pdserve_router_http_requests",
            "OpenAI HTTP API requests, by endpoint and HTTP status (streams: the status sent).",
            labels=["endpoint", "status"],
        )
        for (endpoint, status), n in sorted(self.stats.by_endpoint_status.items()):
            family.add_metric([endpoint, str(status)], n)
        yield family


ENDPOINTS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/models",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/health",
        "/version",
    }
)


class _Count:
    """Counts requests by endpoint and status (plain ASGI: BaseHTTPMiddleware
    would wrap every stream and its disconnects)."""

    def __init__(self, app, stats: HttpStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 499  # no status line sent: the client left first

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # Known paths only: a scanner's made-up paths must not grow the label set.
            path = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.stats.by_endpoint_status[(path, status)] += 1


def build_app(
    servicer: RouterServicer,
    auth,
    stats: HttpStats,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    lora_updates: tuple[LoRAAdmin, object] | None = None,
) -> FastAPI:
    """``auth``: the gRPC TokenAuthInterceptor (same tokens file, same rights), or
    None; the parsers: the router's --tool-call-parser and --reasoning-parser;
    ``lora_updates``: with --allow-runtime-lora-updating, the adapters' admin
    and the admin API's token check (None: none), for vLLM's run-time LoRA
    endpoints (router/http/lora_updates.py)."""
    edge = _Edge(servicer, auth, tool_call_parser, reasoning_parser)
    app = FastAPI(title="pdserve", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(_Count, stats=stats)
    _add_error_handlers(app)
    authorized = [Depends(edge.authorize)]
    app.get("/health")(_health)
    app.get("/version")(_version)
    app.get("/v1/models", dependencies=authorized)(edge.models)
    app.post("/v1/completions", dependencies=authorized)(edge.completions)
    app.post("/v1/chat/completions", dependencies=authorized)(edge.chat)
    app.post("/v1/responses", dependencies=authorized)(edge.responses)
    if lora_updates is not None:
        add_lora_routes(app, *lora_updates, _parse)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape (router/http/errors.py), never a traceback."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError):
        return invalid_body(e.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        return ApiError(e.status_code, str(e.detail), "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, e: Exception):
        return ApiError(500, f"internal error: {type(e).__name__}", "server_error").response()


async def _health():
    return JSONResponse({})


async def _version():
    try:
        return {"version": package_version("pdserve")}
    except PackageNotFoundError:  # a source checkout that was never installed
        return {"version": "dev"}


class _Edge:
    """The routes' work: JSON in, the servicer's one request path, OpenAI JSON out."""

    def __init__(
        self, servicer: RouterServicer, auth, tool_parser: str | None, reasoning: str | None
    ) -> None:
        self.tool_parser = tool_parser
        self.reasoning = reasoning is not None
        self.servicer = servicer
        self.frontend = servicer.frontend
        self.model_id = servicer.frontend.model_id
        self.auth = auth

    async def authorize(self, request: Request) -> None:  # async: FastAPI runs a def on a thread
        if self.auth is None:
            return
        header = request.headers.get("authorization")
        refusal = self.auth.check(GENERATE_METHOD, [("authorization", header)] if header else [])
        if refusal is not None:
            raise ApiError.from_failure(RequestFailed(*refusal))

    async def check_model(self, model: str | None) -> str:
        """The model the body names, the base or a LoRA adapter (router/models.py):
        the name responses carry. 404 model_not_found (OpenAI's) for another."""
        try:
            await self.servicer.routing.model(model or "")
        except ModelNotFound as e:
            raise ApiError(404, str(e), "not_found_error", "model", "model_not_found") from None
        return model or self.model_id

    async def models(self):
        # The nodes' context length (router/limits.py), read now: no request may have read it yet.
        routing = self.servicer.routing
        await routing.read_nodes()
        created = int(time.time())
        entry = {
            "id": self.model_id,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "root": self.model_id,
            "parent": None,
            "max_model_len": self.frontend.max_model_len,
        }
        # LoRA adapters as vLLM lists them: their parent is the base model.
        adapters = [
            {**entry, "id": name, "root": name, "parent": self.model_id}
            for name in routing.adapters
        ]
        return {"object": "list", "data": [entry, *adapters]}

    async def completions(self, request: Request):
        body = await _parse(request, CompletionRequest)
        model = await self.check_model(body.model)
        generate = _to_generate(body.to_generate)
        for g in generate:
            g.model = body.model or ""
        constraint = _to_generate(body.constraint)
        echo = [_prompt_text(self.frontend, g) for g in generate] if body.echo else None
        echo_logprobs = _echo_logprobs(self.frontend, generate) if body.echo_logprobs else None
        prompt_ids = [[] for _ in generate] if body.return_token_ids else None
        assembler = Assembler(
            self.frontend,
            "cmpl",
            model,
            body.n,
            len(generate),
            chat=False,
            echo=echo,
            echo_logprobs=echo_logprobs,
            echo_only=body.echo_only,
            prompt_logprobs=body.prompt_logprobs is not None,
            prompt_ids=prompt_ids,
        )
        return await self.run(
            request, body, generate, assembler, constraint.param if constraint else None, prompt_ids
        )

    async def chat(self, request: Request):
        body = await _parse(request, ChatCompletionRequest)
        model = await self.check_model(body.model)
        generate, assembler, plan = self.chat_request(body, model)
        return await self.run(
            request, body, [generate], assembler, plan.constraint_param, assembler.prompt_ids
        )

    def chat_request(self, body: ChatCompletionRequest, model: str):
        """The request's GenerateRequest (for the base model or the adapter
        ``model`` names), its Assembler and its output plan."""
        generate, plan = _to_generate(lambda: body.to_generate(self.tool_parser, self.reasoning))
        generate.model = body.model or ""
        assembler = Assembler(
            self.frontend,
            "chatcmpl",
            model,
            body.n,
            1,
            chat=True,
            top_logprobs=body.top_logprobs or 0,
            prompt_logprobs=body.prompt_logprobs is not None,
            output=plan,
            prompt_ids=[[]] if body.return_token_ids else None,
        )
        return generate, assembler, plan

    async def responses(self, request: Request):
        """OpenAI's Responses API: the body as a chat request (router/http/responses.py),
        the chat output reshaped (router/http/response_output.py)."""
        body = await _parse(request, ResponsesRequest)
        model = await self.check_model(body.model)
        try:
            chat = _to_generate(body.to_chat)
            generate, assembler, plan = self.chat_request(chat, model)
            shaped = ResponsesAssembler(assembler, body, body.echo())
            return await self.run(request, chat, [generate], shaped, plan.constraint_param)
        except ApiError as e:  # named as the Responses body names it
            e.param = responses_param(e.param)
            raise

    async def run(
        self,
        request: Request,
        body,
        generate: list,
        assembler: Assembler,
        constraint_param: str | None = None,
        prompt_ids: list[list[int]] | None = None,
    ):
        """``prompt_ids``: return_token_ids' lists, one per prompt, that the
        request path fills before the first message (so before any byte is sent)."""
        timeout = _timeout_of(request)
        # The client's W3C trace context: the request's span is its child (common/tracing.py).
        traceparent = request.headers.get(TRACEPARENT_KEY, "")
        sinks = prompt_ids or [None] * len(generate)
        streams = [
            self.servicer.generate(g, timeout, traceparent, sink)
            for g, sink in zip(generate, sinks, strict=True)
        ]
        try:
            # The first message of each before any byte is sent: a refusal
            # (400, 429, 503...) gets its HTTP status, even when streaming.
            first = await _until_disconnected(request, _firsts(streams))
        except RequestFailed as e:
            await _close(streams)
            error = ApiError.from_failure(e)
            # The engine's messages start with the field they refuse: name it as param.
            field_name = e.details.split(" ", 1)[0]
            if error.status == 400 and field_name in type(body).model_fields:
                error.param = field_name
            elif error.status == 400 and field_name.startswith("structured_outputs"):
                # The spec came from this field (response_format, tool_choice...):
                # the message names it as the client wrote it.
                field_name = field_name.rstrip(":")
                if constraint_param is not None:
                    error.message = constraint_param + e.details[len(field_name) :]
                error.param = constraint_param or field_name
            raise error from None
        except BaseException:
            await _close(streams)
            raise
        merged = _merged(streams, first)
        if body.stream:
            return EventSourceResponse(_sse(merged, assembler, body.include_usage))
        try:
            async with contextlib.aclosing(merged):
                await _until_disconnected(request, _collect(merged, assembler))
        except RequestFailed as e:
            raise ApiError.from_failure(e) from None
        return JSONResponse(assembler.whole())


def _timeout_of(request: Request) -> float | None:
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise ApiError(400, f"{TIMEOUT_HEADER} must be seconds > 0", "invalid_request_error")
    return value


def _to_generate(build):
    try:
        return build()
    except InvalidField as e:
        raise ApiError(400, str(e), "invalid_request_error", e.param) from None


async def _parse(request: Request, schema):
    # JSON whatever the Content-Type says (curl -d sends form-urlencoded).
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as e:
        raise invalid_body(e.errors()) from None


async def _firsts(streams: list[AsyncIterator]) -> list:
    if len(streams) == 1:  # no task and no gather: each a loop turn on the first token's way
        return [await anext(streams[0])]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:  # one failed (or the client left): the others end too, downstream included
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(merged, assembler: Assembler) -> None:
    async for index, response in merged:
        assembler.add(index, response)


async def _until_disconnected(request: Request, work):
    """``work``'s result; cancelled (aborting downstream, freeing the nodes'
    blocks) when the client drops the connection first. ``work`` runs in this
    task, not in one of its own: a task's result reaches its waiter loop turns
    later, and under load each turn waits behind the other streams' messages."""
    me = asyncio.current_task()
    left = False

    async def gone() -> None:
        nonlocal left
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left = True
        me.cancel()

    watcher = asyncio.ensure_future(gone())
    try:
        return await work
    except asyncio.CancelledError:
        if left:
            raise asyncio.CancelledError("the client disconnected") from None
        raise
    finally:
        watcher.cancel()


async def _close(streams) -> None:
    for s in streams:
        with contextlib.suppress(BaseException):
            await s.aclose()


async def _merged(
    streams: list, first: list
) -> AsyncIterator[tuple[int, pdserve_pb2.GenerateResponse]]:
    """(prompt index, response) of every stream, interleaved as they come."""
    try:
        for i, response in enumerate(first):
            yield i, response
        if len(streams) == 1:  # the common case: no tasks, no queue
            async for response in streams[0]:
                yield 0, response
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream) -> None:
            try:
                async for response in stream:
                    await queue.put((i, response, None))
            except Exception as e:  # RequestFailed: handed to the consumer
                await queue.put((i, None, e))
            await queue.put((i, None, None))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            running = len(pumps)
            while running:
                i, response, error = await queue.get()
                if error is not None:
                    raise error
                if response is None:
                    running -= 1
                    continue
                yield i, response
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
    finally:
        await _close(streams)


async def _sse(merged, assembler: Assembler, include_usage: bool):
    # Starlette cancels this generator when the client disconnects: aclosing
    # then closes the streams, which cancels the Decode calls downstream.
    async with contextlib.aclosing(merged):
        try:
            if start := assembler.start_events():
                yield start
            # One write per message from the node, all its chunks together.
            async for index, response in merged:
                if events := assembler.events(index, response):
                    yield events
            yield assembler.end_events(include_usage)
        except RequestFailed as e:
            # Mid-stream the status line is sent already: the error goes in the stream.
            yield assembler.error_events(ApiError.from_failure(e).body())


def _echo_logprobs(frontend, generate: list) -> EchoLogprobs:
    """Each prompt's first token: what the router's tokenizer makes of its text
    (the InputProcessor's own call), or its first id."""
    firsts = []
    for g in generate:
        if g.WhichOneof("input") == "token_ids":
            firsts.append(g.token_ids.ids[0])
        elif frontend.tokenizer is None:
            raise ApiError(400, "echo of text needs a tokenizer", "invalid_request_error", "echo")
        else:
            firsts.append((frontend.tokenizer.encode(g.prompt) or [0])[0])
    return EchoLogprobs(firsts)


def _prompt_text(frontend, request: pdserve_pb2.GenerateRequest) -> str:
    if request.WhichOneof("input") == "prompt":
        return request.prompt
    if frontend.tokenizer is None:
        raise ApiError(400, "echo of token ids needs a tokenizer", "invalid_request_error", "echo")
    return frontend.tokenizer.decode(list(request.token_ids.ids))


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The router's own handlers (router/main.py) stop it with the gRPC servers.
        yield


def make_server(
    app: FastAPI, host: str, port: int, tls: TLSConfig, drain_s: float, keep_alive_s: int
) -> uvicorn.Server:
    """With the gRPC port's TLS files (mTLS: --tls-client-ca); keep_alive_s: router/main.py."""
    paths = dict(tls.paths)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=max(1, int(drain_s)),
        timeout_keep_alive=keep_alive_s,
        ssl_certfile=paths.get("--tls-cert"),
        ssl_keyfile=paths.get("--tls-key"),
        ssl_ca_certs=paths.get("--tls-client-ca"),
        ssl_cert_reqs=ssl.CERT_REQUIRED if "--tls-client-ca" in paths else ssl.CERT_NONE,
    )
    return _Server(config)
