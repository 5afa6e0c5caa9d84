"""The /metrics HTTP endpoint of one process, its flag, and port plans for `pdserve up`.

Each process builds its own ``CollectorRegistry`` holding only its collectors
(no default registry, no process or platform collectors from module globals)
and serves it from prometheus-client's threaded HTTP server. A port that
cannot be bound is logged and skipped: the process keeps serving requests
(Prometheus then reports the target down, which is what alerts catch).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9400
METRICS_PATH = "/metrics"


def metrics_port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"metrics port must be 0 (off) to 65535, got {port}")
    return port


def add_metrics_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=metrics_port(os.environ.get("PDSERVE_METRICS_PORT", str(DEFAULT_METRICS_PORT))),
        help=f"Prometheus {METRICS_PATH} port, 0 disables "
        f"(default {DEFAULT_METRICS_PORT}) [PDSERVE_METRICS_PORT]",
    )


@dataclass(slots=True)
class MetricsServer:
    registry: CollectorRegistry
    host: str
    port: int
    _httpd: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}{METRICS_PATH}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def make_registry(collectors: Iterable[Collector]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return registry


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:
        pass  # one line per scrape would drown the process's log


def metrics_only_app(registry: CollectorRegistry):
    """The metrics on METRICS_PATH, 404 on any other path (a typo should not
    look like a working endpoint)."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [f"not found: the metrics are at {METRICS_PATH}\n".encode()]
        return metrics(environ, start_response)

    return app


def _start(port: int, host: str, registry: CollectorRegistry):
    httpd = make_server(
        host, port, metrics_only_app(registry), _ThreadingServer, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    return httpd, thread


def serve_metrics(
    port: int, host: str, collectors: Iterable[Collector], what: str = "metrics"
) -> MetricsServer | None:
    """Serve ``collectors`` on ``host:port`` at ``/metrics`` (other paths: 404).
    Returns None when ``port`` is 0 or cannot be bound. ``what``: the log's name for it."""
    if port == 0:
        logger.info("metrics endpoint disabled (--metrics-port 0)")
        return None
    registry = make_registry(collectors)
    try:
        httpd, thread = _start(port, host, registry)
    except OSError as e:
        logger.error("metrics endpoint not started: cannot listen on %s:%d (%s)", host, port, e)
        return None
    server = MetricsServer(registry, host, httpd.server_port, httpd, thread)
    logger.info("%s on %s", what, server.url)
    return server


def plan_metrics_ports(base: int | None, names: Sequence[str], pick_free) -> dict[str, int]:
    """Ports for processes sharing one host: ``base`` + their index in ``names``,
    a free port each when ``base`` is None (tests), all 0 (off) when ``base`` is 0."""
    if base is None:
        return {name: pick_free() for name in names}
    if base == 0:
        return dict.fromkeys(names, 0)
    if base + len(names) - 1 > 65535:
        raise ValueError(f"metrics ports {base}..{base + len(names) - 1} exceed 65535")
    return {name: base + i for i, name in enumerate(names)}
