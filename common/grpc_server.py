"""What every pdserve gRPC server shares: health, reflection, error mapping, health
probes, and the public edge's answers to requests a servicer never sees (bodies that
do not parse, oversized metadata)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.runtime.node_lora import AdapterRefused
from common.runtime.reliability import NoCapacity
from common.tls import NO_TLS, TLSConfig, make_sync_channel

OVERALL = ""  # the health service's name for the whole server

# A short reconnect backoff lets a restarted node be used again soon after it
# is back (the default grows to two minutes). A peer that stops answering
# without closing its connection is found otherwise (router: a silent stream's
# decode node gets a health probe; decode node: the KV lease): HTTP/2 keepalive
# pings were tried and did not fire against a SIGSTOPped peer in this grpcio.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
SERVER_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]

# Oversized request metadata. gRPC's transport counts it as HTTP/2 does (name +
# value + 32 bytes per entry, pseudo-headers included) and by default refuses
# it with RESOURCE_EXHAUSTED and a transport message: beyond 8 KiB at random
# (ever more often up to 16 KiB), always beyond 16 KiB. Public servers move both
# transport limits to METADATA_HARD_LIMIT, and MetadataLimitInterceptor refuses
# beyond METADATA_LIMIT (same measure, over the entries the application sees)
# with INVALID_ARGUMENT, every time; only requests beyond the hard limit still
# get the transport's RESOURCE_EXHAUSTED.
METADATA_LIMIT = 8 << 10
METADATA_HARD_LIMIT = 256 << 10
PUBLIC_SERVER_OPTIONS = [
    *SERVER_OPTIONS,
    # Soft = hard: no band where the transport refuses at random.
    ("grpc.max_metadata_size", METADATA_HARD_LIMIT),
    ("grpc.absolute_max_metadata_size", METADATA_HARD_LIMIT),
]


async def add_health(
    server: grpc.aio.Server, service_names: list[str]
) -> health.aio.HealthServicer:
    """Register grpc.health.v1, every service NOT_SERVING until told otherwise.

    Explicitly so: the servicer answers SERVING for the whole server ("") from
    the start, and launchers and probes would then use a node before it has
    registered in Redis.
    """
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await set_serving(servicer, service_names, False)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, names: list[str], serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in [OVERALL, *names]:
        await servicer.set(name, status)


def add_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection([*service_names, reflection.SERVICE_NAME], server)


def health_check(
    address: str, service: str = OVERALL, timeout: float = 1.0, tls: TLSConfig = NO_TLS
) -> bool:
    """True when the server at ``address`` answers SERVING (sync; for launchers and tests)."""
    try:
        with make_sync_channel(address, tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_serving(
    address: str, timeout: float, service: str = OVERALL, tls: TLSConfig = NO_TLS
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_check(address, service, tls=tls):
            return True
        time.sleep(0.2)
    return False


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """What went wrong as a status code with a one-line message."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or str(error.code())
    if isinstance(error, NoCapacity):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)
    if isinstance(error, AdapterRefused):
        return error.code, str(error)
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, asyncio.TimeoutError | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


async def abort_from_exception(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    await context.abort(*status_of(error))


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of ``handler``'s kind (and (de)serializers) that answers ``code``, ``message``."""

    async def deny(request, context):
        await context.abort(code, message)

    async def deny_stream(request, context):
        await deny(request, context)
        yield  # pragma: no cover - never reached; makes this an async generator

    kwargs = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)


def metadata_size(metadata) -> int:
    """A call's metadata in bytes as HTTP/2 counts it: name + value + 32 per entry."""
    return sum(
        len(key) + len(value if isinstance(value, bytes) else value.encode()) + 32
        for key, value in metadata or ()
    )


class MetadataLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata exceeds ``limit`` bytes with INVALID_ARGUMENT.

    The transport limits must be higher (PUBLIC_SERVER_OPTIONS) for such calls
    to get this far. Put it first among the interceptors: the check is cheap,
    and a later token check need not read a huge header.
    """

    def __init__(self, limit: int = METADATA_LIMIT) -> None:
        self.limit = limit

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        size = metadata_size(details.invocation_metadata)
        if size <= self.limit:
            return handler
        return refusing_handler(
            handler,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request metadata is {size} bytes, over this server's limit of {self.limit} "
            f"bytes ({self.limit >> 10} KiB, counting name + value + 32 bytes per entry)",
        )


class Undecodable:
    """What a lenient deserializer returns for bytes that do not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def lenient_deserializer(message_class):
    """``message_class.FromString``, returning an Undecodable instead of raising.

    gRPC answers a deserializer's exception itself, with UNKNOWN ("Unexpected
    <class 'google.protobuf.message.DecodeError'>: ...") or INTERNAL, before
    the servicer runs; a client that sent, say, invalid UTF-8 in a string
    field should get INVALID_ARGUMENT naming the field.
    """

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as e:  # whatever the parser refuses, the client sent it
            return Undecodable(decode_error_message(message_class.DESCRIPTOR, data, e))

    return deserialize


def decode_error_message(descriptor: Descriptor, data: bytes, error: BaseException) -> str:
    where = f"the request is not a valid {descriptor.full_name}"
    field = invalid_utf8_field(descriptor, data)
    if field is not None:
        return f"{where}: {field} is not valid UTF-8 (string fields must hold UTF-8 text)"
    return f"{where}: {error}"


def invalid_utf8_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path (``chat.messages[1].content``) of the first string field in the
    serialized ``data`` that is not UTF-8; None if there is none, or if ``data``
    is too broken to tell (protobuf's own message then says what it found)."""
    occurrences: Counter[int] = Counter()
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                size, pos = _varint(data, pos)
                if pos + size > len(data):
                    return None  # truncated: a cut character is not a UTF-8 error
                chunk, pos = data[pos : pos + size], pos + size
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.is_repeated:
                    name += f"[{occurrences[number]}]"
                    occurrences[number] += 1
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = invalid_utf8_field(field.message_type, chunk, name + ".")
                    if found is not None:
                        return found
            else:  # groups (proto2 only) or garbage
                return None
    except IndexError:  # truncated
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def add_lenient_servicer(server: grpc.aio.Server, service: ServiceDescriptor, servicer) -> None:
    """Register an aio ``servicer`` for ``service`` as the generated
    ``add_*Servicer_to_server`` does, except that a unary request that does not
    parse gets INVALID_ARGUMENT naming the problem instead of UNKNOWN.

    Response-streaming methods must be async generators. Client-streaming
    methods keep the strict parser.
    """
    handlers = {}
    for method in service.methods:
        request_class = GetMessageClass(method.input_type)
        response_class = GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        deserializer = request_class.FromString
        if not method.client_streaming:
            behavior = _refuse_undecodable(behavior, method.server_streaming)
            deserializer = lenient_deserializer(request_class)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[method.client_streaming, method.server_streaming]
        handlers[method.name] = make(
            behavior,
            request_deserializer=deserializer,
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def _refuse_undecodable(behavior, server_streaming: bool):
    if server_streaming:

        async def stream(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            # Closing this generator closes the servicer's at once (its finally
            # blocks cancel downstream calls), not whenever it is collected.
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return stream

    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await behavior(request, context)

    return unary
