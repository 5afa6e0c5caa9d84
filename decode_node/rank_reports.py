"""News from the other ranks of a tensor-parallel decode node to rank 0.

Each rank lands its own KV heads of a reservation; rank 0 commits the request
only once every rank's part has landed, and fails it when any part fails.
Every other rank holds one TCP connection to a listener rank 0 opens on the
loopback interface and writes one JSON object per line (no pickle): ``landed``
(with the bytes it scattered), ``failed`` (with why), ``peer_failed`` (a pair
channel from a prefill node broke under an epoch) or ``late`` (a segment for a
reservation that was gone, dropped). Rank 0 reads each connection on a thread
of its own and hands the reports to its landing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Report:
    kind: str  # "landed", "failed", "peer_failed" or "late"
    rank: int
    reservation_id: int = 0
    num_bytes: int = 0
    peer: str = ""
    epoch: int = 0
    message: str = ""


KINDS = ("landed", "failed", "peer_failed", "late")


class ReportListener:
    """Rank 0's end: ``handler`` gets every report, on the connection's thread."""

    def __init__(self, handler: Callable[[Report], None]) -> None:
        self.handler = handler
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name="rank-reports", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r", encoding="utf-8") as lines:
            for line in lines:
                try:
                    data = json.loads(line)
                    if data.get("kind") not in KINDS:
                        raise ValueError(f"unknown report kind {data.get('kind')!r}")
                    report = Report(**data)
                except (ValueError, TypeError) as e:
                    logger.error("a rank sent an unreadable report (%s): %r", e, line[:200])
                    continue
                try:
                    self.handler(report)
                except Exception:
                    logger.exception("handling a rank's report failed: %s", report)
        if not self._closed:
            logger.warning("a tensor-parallel rank closed its report connection")

    def close(self) -> None:
        self._closed = True
        self._server.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class ReportClient:
    """Another rank's end (any thread)."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._lock = threading.Lock()

    def send(self, report: Report) -> None:
        line = (json.dumps(asdict(report), separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._sock.sendall(line)
