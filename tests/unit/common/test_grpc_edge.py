"""The public server's edge (common/grpc_server.py): request bytes that do not
parse and oversized metadata get INVALID_ARGUMENT naming the problem, on an
in-process server configured as the router's is, with and without tokens."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from common.auth import GENERATE, StaticToken, TokenAuthInterceptor
from common.grpc_server import (
    METADATA_HARD_LIMIT,
    METADATA_LIMIT,
    PUBLIC_SERVER_OPTIONS,
    MetadataLimitInterceptor,
    add_lenient_servicer,
    invalid_utf8_field,
    metadata_size,
)
from proto import pdserve_pb2, pdserve_pb2_grpc

METHOD = "/pdserve.v1.Router/Generate"
ROUTER = pdserve_pb2.DESCRIPTOR.services_by_name["Router"]
TOKEN = "unit-test-token-0123456789"
BAD = b"\xc3\x28\xff\xfe"  # not UTF-8 (a broken 2-byte sequence, then bytes never valid)
MARK = "ZZZZ"  # same length as BAD: swapping them keeps every length prefix right


class EchoRouter(pdserve_pb2_grpc.RouterServicer):
    """Streams back the prompt; ``forever`` prompts stream until cancelled."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    async def Generate(self, request, context):
        try:
            yield pdserve_pb2.GenerateResponse(request_id=request.request_id)
            while request.prompt == "forever":
                await asyncio.sleep(0.01)
                yield pdserve_pb2.GenerateResponse(request_id=request.request_id)
        finally:
            self.closed.set()


class Server:
    """An aio server on its own thread's event loop, set up as router/main.py does."""

    def __init__(self, auth: bool) -> None:
        self.servicer = EchoRouter()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        interceptors = [MetadataLimitInterceptor()]
        if auth:
            interceptors.append(
                TokenAuthInterceptor([StaticToken(TOKEN, "unit", rights=(GENERATE,))])
            )
        self.port = self.call(self._start(interceptors))

    async def _start(self, interceptors) -> int:
        self.server = grpc.aio.server(interceptors=interceptors, options=PUBLIC_SERVER_OPTIONS)
        add_lenient_servicer(self.server, ROUTER, self.servicer)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module", params=[False, True], ids=["open", "tokens"])
def server(request):
    s = Server(auth=request.param)
    s.auth = request.param
    yield s
    s.stop()


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        yield ch


def metadata(server, extra=()):
    return [*extra, *([("authorization", f"Bearer {TOKEN}")] if server.auth else [])]


def raw_generate(channel, data: bytes, md) -> tuple[grpc.StatusCode, str, list]:
    call = channel.unary_stream(
        METHOD,
        request_serializer=None,  # bytes as they are
        response_deserializer=pdserve_pb2.GenerateResponse.FromString,
    )
    try:
        return grpc.StatusCode.OK, "", list(call(data, metadata=md, timeout=10))
    except grpc.RpcError as e:
        return e.code(), e.details() or "", []


def corrupt(request: pdserve_pb2.GenerateRequest) -> bytes:
    data = request.SerializeToString()
    assert data.count(MARK.encode()) == 1
    return data.replace(MARK.encode(), BAD)


def with_mark(where: str) -> tuple[pdserve_pb2.GenerateRequest, str]:
    """A valid request with MARK in one string field, and that field's path."""
    r = pdserve_pb2.GenerateRequest(prompt="hello", request_id="r1")
    if where == "prompt":
        r.prompt = MARK
    elif where in ("content", "role"):
        r.chat.messages.add(role="system", content="be brief")
        r.chat.messages.add(role="user", content="hi")
        setattr(r.chat.messages[1], where, MARK)
        return r, f"chat.messages[1].{where}"
    elif where == "stop":
        r.sampling.stop.extend(["a", MARK])
        return r, "sampling.stop[1]"
    else:
        setattr(r, where, MARK)
    return r, where


FIELDS = ["prompt", "content", "role", "stop", "cache_salt", "request_id"]


@pytest.mark.parametrize("where", FIELDS)
def test_invalid_utf8_field_names_the_field(where):
    request, path = with_mark(where)
    assert invalid_utf8_field(pdserve_pb2.GenerateRequest.DESCRIPTOR, corrupt(request)) == path
    assert invalid_utf8_field(request.DESCRIPTOR, request.SerializeToString()) is None


def test_invalid_utf8_field_gives_up_on_truncated_bytes():
    data = pdserve_pb2.GenerateRequest(prompt="déjà vu").SerializeToString()
    # Cut inside "é": a truncated field, not a UTF-8 error.
    assert invalid_utf8_field(pdserve_pb2.GenerateRequest.DESCRIPTOR, data[:4]) is None
    # Bad UTF-8 in a field before the cut is still found.
    request, path = with_mark("stop")
    assert invalid_utf8_field(request.DESCRIPTOR, corrupt(request)[:-1]) == path


@pytest.mark.parametrize("where", FIELDS)
def test_invalid_utf8_is_invalid_argument_naming_the_field(server, channel, where):
    request, path = with_mark(where)
    code, details, _ = raw_generate(channel, corrupt(request), metadata(server))
    assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert f"{path} is not valid UTF-8" in details
    assert "pdserve.v1.GenerateRequest" in details


def test_bytes_that_do_not_parse_are_invalid_argument(server, channel):
    data = pdserve_pb2.GenerateRequest(prompt="hello there").SerializeToString()[:-3]
    code, details, _ = raw_generate(channel, data, metadata(server))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid pdserve.v1.GenerateRequest" in details


def test_a_valid_request_still_streams(server, channel):
    data = pdserve_pb2.GenerateRequest(prompt="héllo", request_id="r2").SerializeToString()
    code, _, responses = raw_generate(channel, data, metadata(server))
    assert code is grpc.StatusCode.OK
    assert [r.request_id for r in responses] == ["r2"]


def test_tokens_are_checked_before_the_body(server, channel):
    request, _ = with_mark("prompt")
    code, _, _ = raw_generate(channel, corrupt(request), [])
    # With tokens, a caller without one learns nothing about its body; without, the body is judged.
    expected = grpc.StatusCode.UNAUTHENTICATED if server.auth else grpc.StatusCode.INVALID_ARGUMENT
    assert code is expected


@pytest.mark.parametrize("kib", [4, 7])
def test_metadata_within_the_limit_passes(server, channel, kib):
    md = metadata(server, [("x-pad", "a" * (kib << 10))])
    assert metadata_size(md) <= METADATA_LIMIT
    data = pdserve_pb2.GenerateRequest(prompt="hi").SerializeToString()
    assert raw_generate(channel, data, md)[0] is grpc.StatusCode.OK


@pytest.mark.parametrize("kib", [9, 16, 64, 200])
@pytest.mark.parametrize("entries", [1, 32])
def test_metadata_over_the_limit_is_invalid_argument(server, channel, kib, entries):
    md = metadata(server, [(f"x-pad-{i}", "a" * ((kib << 10) // entries)) for i in range(entries)])
    data = pdserve_pb2.GenerateRequest(prompt="hi").SerializeToString()
    for _ in range(3):  # the transport's soft limit refused at random; this must not
        code, details, _ = raw_generate(channel, data, md)
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert f"limit of {METADATA_LIMIT} bytes" in details


def test_metadata_over_the_transport_limit_is_resource_exhausted(server, channel):
    # Refused while the headers are parsed: nothing reaches the application.
    md = metadata(server, [("x-pad", "a" * (METADATA_HARD_LIMIT + 1024))])
    data = pdserve_pb2.GenerateRequest(prompt="hi").SerializeToString()
    code, details, _ = raw_generate(channel, data, md)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "exceeds hard limit" in details


def test_cancelling_closes_the_servicers_stream_at_once(server, channel):
    server.servicer.closed.clear()
    call = channel.unary_stream(METHOD, request_serializer=None, response_deserializer=lambda b: b)(
        pdserve_pb2.GenerateRequest(prompt="forever").SerializeToString(), metadata=metadata(server)
    )
    next(call)
    next(call)
    start = time.monotonic()
    call.cancel()
    assert server.servicer.closed.wait(5)
    assert time.monotonic() - start < 1.0
