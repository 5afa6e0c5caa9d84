"""An OTLP trace collector in the test process: a real gRPC server of
OpenTelemetry's TraceService that keeps every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from pdserve.redis_server import free_port


@dataclass(slots=True, frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Collector:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(None)

    def Export(self, request, context):
        got = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value for a in resource_spans.resource.attributes}
            service = attrs["service.name"].string_value if "service.name" in attrs else ""
            for scope in resource_spans.scope_spans:
                got += [_received(service, span) for span in scope.spans]
        with self._lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        """The spans once ``predicate(spans)`` holds (AssertionError after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans never matched; got {[s.name for s in spans]}")
            time.sleep(0.1)


def _received(service: str, span) -> ReceivedSpan:
    attributes = {}
    for a in span.attributes:
        value = a.value
        kind = value.WhichOneof("value")
        attributes[a.key] = getattr(value, kind) if kind else None
    return ReceivedSpan(
        service,
        span.name,
        span.trace_id.hex(),
        span.span_id.hex(),
        span.parent_span_id.hex(),
        span.start_time_unix_nano,
        span.end_time_unix_nano,
        attributes,
    )
