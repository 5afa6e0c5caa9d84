"""What every pdserve gRPC server shares: health, reflection, error mapping, health probes."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.reliability import NoCapacity
from common.tls import NO_TLS, TLSConfig, make_sync_channel

OVERALL = ""  # the health service's name for the whole server

# A short reconnect backoff lets a restarted node be used again soon after it
# is back (the default grows to two minutes). A peer that stops answering
# without closing its connection is found by its heartbeat instead (router:
# RouterServicer's silence check; decode node: the KV lease): HTTP/2 keepalive
# pings were tried and did not fire against a SIGSTOPped peer in this grpcio.
CLIENT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
SERVER_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]


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


async def abort_from_exception(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """Map what went wrong to a status code with a one-line message."""
    if isinstance(error, grpc.aio.AioRpcError):
        await context.abort(error.code(), error.details() or str(error.code()))
    if isinstance(error, NoCapacity):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
    if isinstance(error, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    if isinstance(error, asyncio.TimeoutError | TimeoutError):
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
