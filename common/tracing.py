"""OpenTelemetry spans of a request's life: router, then decode node and prefill node.

A request is one trace. The router's span ("request") is the child of the
client's W3C trace context where the client sent one (the gRPC metadata key or
the HTTP header ``traceparent``), else a trace's root; its context travels to
the nodes inside the request messages (``DecodeRequest.traceparent``,
``PrefillRequest.traceparent``: one long-lived session carries many requests,
so per-request gRPC metadata is not available there). The decode node's span
("decode": its admission, the wait for the KV, the first output) and the
prefill node's ("prefill": queue, compute, the KV left after the last layer)
are children of the router's.

Every span is recorded when its request ends, from times the process kept
anyway: nothing on the data path waits for, or does work for, telemetry.
Spans are exported over OTLP (gRPC) when ``--otlp-endpoint`` or
``OTEL_EXPORTER_OTLP_ENDPOINT`` names a collector; that needs the
``opentelemetry-sdk`` and OTLP exporter packages (``pip install
'pdserve[otel]'``). Without an endpoint nothing is recorded; without the
packages an endpoint is a start-up error, and nothing else changes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

TRACEPARENT_KEY = "traceparent"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"


def epoch_ns(monotonic: float) -> int:
    """A time.monotonic() reading as nanoseconds since the epoch (span times)."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


def add_tracing_arguments(parser) -> None:
    parser.add_argument(
        "--otlp-endpoint",
        default=os.environ.get(ENDPOINT_ENV) or None,
        help="export OpenTelemetry spans of every request to this OTLP gRPC collector, "
        "e.g. http://localhost:4317 (needs the otel extra) [OTEL_EXPORTER_OTLP_ENDPOINT]",
    )


class Tracing:
    """One process's tracer: spans of whole requests, recorded after the fact.
    A no-op (``enabled`` False) where no endpoint is configured."""

    def __init__(self, service: str, endpoint: str | None, instance: str = "") -> None:
        self.enabled = bool(endpoint)
        self._tracer = None
        self._provider = None
        if self.enabled:
            self._tracer, self._provider = _otlp_tracer(service, endpoint, instance)

    @classmethod
    def off(cls) -> Tracing:
        return cls("", None)

    def start(self, name: str, parent: str = "", start: float | None = None) -> Span:
        """A span begun at ``start`` (time.monotonic(); now by default), the child
        of the W3C ``parent`` context where there is one. End it with ``end``."""
        if not self.enabled:
            return Span(None, parent, None)
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = TraceContextTextMapPropagator().extract({TRACEPARENT_KEY: parent})
        span = self._tracer.start_span(
            name,
            context=context,
            kind=trace.SpanKind.SERVER,
            start_time=epoch_ns(time.monotonic() if start is None else start),
        )
        return Span(span, _traceparent_of(span), self._tracer)

    def record(
        self,
        name: str,
        parent: str,
        start: float,
        end: float,
        attributes: Mapping[str, Any] | None = None,
        children: list[tuple[str, float, float]] = (),
    ) -> None:
        """A whole span from ``start`` to ``end`` (time.monotonic()), with a child
        span per (name, start, end); children with no time (an end not after
        their start) are left out."""
        if not self.enabled:
            return
        span = self.start(name, parent, start)
        span.end(end, attributes, children)

    def shutdown(self) -> None:
        """Export what is left (a stopping process)."""
        if self._provider is not None:
            self._provider.shutdown()


class Span:
    """A span in flight (or a no-op one), and the W3C context its children name."""

    __slots__ = ("_span", "_tracer", "traceparent")

    def __init__(self, span, traceparent: str, tracer) -> None:
        self._span = span
        self._tracer = tracer
        # What goes downstream: this span's context, or the parent's where
        # nothing is recorded here (the trace then goes on past this process).
        self.traceparent = traceparent

    def end(
        self,
        end: float | None = None,
        attributes: Mapping[str, Any] | None = None,
        children: list[tuple[str, float, float]] = (),
    ) -> None:
        if self._span is None:
            return
        from opentelemetry import trace

        context = trace.set_span_in_context(self._span)
        for name, child_start, child_end in children:
            if child_end > child_start:
                start_ns = epoch_ns(child_start)
                child = self._tracer.start_span(name, context=context, start_time=start_ns)
                child.end(end_time=epoch_ns(child_end))
        if attributes:
            self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        self._span.end(end_time=epoch_ns(time.monotonic() if end is None else end))


def _traceparent_of(span) -> str:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT_KEY, "")


def _otlp_tracer(service: str, endpoint: str, instance: str):
    """A tracer whose spans go, batched, to the OTLP collector at ``endpoint``."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ValueError(
            f"--otlp-endpoint {endpoint} needs the OpenTelemetry SDK and its OTLP exporter "
            f"(pip install 'pdserve[otel]'): {e}"
        ) from e
    attributes = {"service.name": service}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(resource=Resource.create(attributes))
    insecure = not endpoint.startswith("https://")
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure))
    )
    logger.info("%s: OpenTelemetry spans go to %s", service, endpoint)
    return provider.get_tracer("pdserve"), provider
