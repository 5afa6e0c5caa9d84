"""A lean HTTP/1.1 client for the load generator's streamed POSTs.

Why not aiohttp: on one core the generator must keep its schedule at ≥ 2,000
requests/s (docs/lab/2026-11-26-load-generator-capacity.md), and with
aiohttp it fell well short of that: a request built a
ClientRequest, a ClientResponse, a payload, a timer and their tasks, and every
line of the event stream was one ``await`` of a stream reader. Here a request
is one write and one future; the response is parsed where its bytes arrive
(``data_received``) and each complete line goes to the caller's callback at
once, so a token's arrival time is the callback's clock, not a task switch
later.

What it speaks: ``POST`` with a body of known length; responses with
``Transfer-Encoding: chunked`` (servers streaming Server-Sent Events: uvicorn,
aiohttp), ``Content-Length`` or neither (the body ends with the connection);
1xx interim responses skipped, 204 and 304 without a body; ``http`` and
``https`` (the system's trust store). Connections are kept alive and reused,
never one idle for longer than ``keepalive_s`` (a server closing an idle
connection as it is reused would lose the request: POSTs are not retried).

A caller may stop early: its sink returns True once it has what it wants (the
stream's ``data: [DONE]``), and the request is answered then, as aiohttp's
reader was left at that line; the connection reads the rest of the response
on its own and goes back to the pool when the response ends, or is closed if
it fails or does not end within ``keepalive_s``. What follows the stop never
decides the request.
"""

from __future__ import annotations

import asyncio
import enum
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

# At most this much of an error response's body is kept (it is quoted in a message).
MAX_ERROR_BODY = 4096
# A response head larger than this is not HTTP we understand.
MAX_HEAD = 65536
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(rb"[0-9]{1,19}")

# Complete lines of a 200 response's body; True: the caller has what it wants.
LineSink = Callable[[list[bytes]], bool]


class ProtocolError(Exception):
    """The server's bytes are not an HTTP/1.1 response."""


def _find_end(buf: bytes, pos: int, sep: bytes, what: str) -> int:
    """Where ``sep`` ends the piece of ``buf`` starting at ``pos`` (-1: not here
    yet); a piece that runs past MAX_HEAD without one is not HTTP we understand."""
    end = buf.find(sep, pos)
    if end < 0 and len(buf) - pos > MAX_HEAD:
        raise ProtocolError(f"{what} over 64 KiB")
    return end


class _State(enum.Enum):
    HEAD = 1  # status line and headers
    CHUNK_SIZE = 2
    CHUNK_DATA = 3
    CHUNK_END = 4  # the CRLF after a chunk's data
    TRAILER = 5
    LENGTH_DATA = 6
    UNTIL_CLOSE = 7
    DONE = 8  # no response being read: idle, ended, failed or closed


@dataclass(slots=True)
class Response:
    status: int
    # The body, for a status other than 200 only (its first MAX_ERROR_BODY bytes).
    error_body: bytes = b""


class _Connection(asyncio.Protocol):
    """One kept-alive connection; one request at a time. ``release`` puts it back
    in its client's pool (once per response that ended cleanly), ``forget``
    drops it from the client's books once it is closed."""

    def __init__(
        self, release: Callable[[_Connection], None], forget: Callable[[_Connection], None]
    ) -> None:
        self._release, self._forget = release, forget
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._state = _State.DONE
        self._reusable = True
        self._done: asyncio.Future[Response] | None = None
        self._sink: LineSink | None = None
        self._stopped = False  # the sink said stop: the caller was answered
        self._response: Response | None = None
        self._buf = b""
        self._pending = b""  # a line's start, its end not received yet
        # Body bytes parsed from one read, handed over together when it is parsed
        # (one split and one call of the sink per read, not per chunk: a server
        # streaming tokens sends one chunk per token, and a read often holds many).
        self._pieces: list[bytes] = []
        self._remaining = 0
        self._received = 0

    # ------------------------------------------------------------- requests
    def request(self, raw: bytes, sink: LineSink) -> asyncio.Future[Response]:
        self._done = asyncio.get_running_loop().create_future()
        self._sink, self._stopped, self._response = sink, False, None
        self._buf = self._pending = b""
        self._pieces.clear()
        self._state, self._reusable, self._received = _State.HEAD, True, 0
        self.transport.write(raw)
        return self._done

    @property
    def reusable(self) -> bool:
        return not self.closed and self._reusable and self._state is _State.DONE

    def abandon(self, request: asyncio.Future[Response]) -> None:
        """The caller gave up on ``request`` (timeout, cancellation): close the
        connection unless that response had ended (it may serve another one by now)."""
        if self._done is request and self._state is not _State.DONE:
            self.close()

    def close(self) -> None:
        self._state, self._reusable, self._sink = _State.DONE, False, None
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # --------------------------------------------------------------- events
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._forget(self)
        if self._state is _State.UNTIL_CLOSE and exc is None:
            try:
                self._finish_lines()  # the body ended with the connection
            except Exception as e:  # the sink's
                self._fail(e)
                return
            self._complete()
        elif self._state is not _State.DONE:
            where = "before answering" if not self._received else "mid-response"
            self._fail(exc or ConnectionError(f"the server closed the connection {where}"))
        self._state, self._sink = _State.DONE, None

    def data_received(self, data: bytes) -> None:
        if self._state is _State.DONE:
            # Nothing asked: a server talking out of turn cannot be trusted with the next.
            self.close()
            return
        self._received += len(data)
        self._buf += data
        try:
            self._parse()
        except Exception as e:  # a ProtocolError, or the sink's own as raised: never the loop's
            self._fail(e)
            return
        if self._stopped and not self._done.done():
            self._done.set_result(self._response)

    def expire(self, request: asyncio.Future[Response]) -> None:
        """A response read on after the caller stopped early that has not ended by now."""
        if self._done is request and self._state is not _State.DONE:
            self.close()

    def _fail(self, error: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self.close()

    # -------------------------------------------------------------- parsing
    def _parse(self) -> None:
        buf, pos = self._buf, 0
        while True:
            state = self._state
            if state is _State.HEAD:
                end = _find_end(buf, pos, b"\r\n\r\n", "response head")
                if end < 0:
                    break
                self._head(buf[pos:end])
                pos = end + 4
            elif state is _State.CHUNK_SIZE:
                end = _find_end(buf, pos, b"\r\n", "chunk size line")
                if end < 0:
                    break
                size = buf[pos:end].split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size):
                    raise ProtocolError(f"chunk size {size[:20]!r}")
                pos = end + 2
                self._remaining = int(size, 16)
                self._state = _State.CHUNK_DATA if self._remaining else _State.TRAILER
            elif state is _State.CHUNK_DATA or state is _State.LENGTH_DATA:
                take = min(self._remaining, len(buf) - pos)
                if not take:
                    break
                self._pieces.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                if state is _State.CHUNK_DATA:
                    self._state = _State.CHUNK_END
                else:
                    self._finish_lines()
                    self._complete()
            elif state is _State.CHUNK_END:
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("chunk not followed by CRLF")
                pos += 2
                self._state = _State.CHUNK_SIZE
            elif state is _State.TRAILER:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                line, pos = buf[pos:end], end + 2
                if not line:  # the empty line that ends the message
                    self._finish_lines()
                    self._complete()
            elif state is _State.UNTIL_CLOSE:
                self._pieces.append(buf[pos:])
                pos = len(buf)
                break
            else:  # DONE: the message ended; anything past it is a server over-sending
                if pos < len(buf):
                    self.close()
                    pos = len(buf)
                break
        self._buf = buf[pos:]
        self._body()

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if (
            len(parts) < 2
            or not parts[0].startswith(b"HTTP/1.")
            or not (len(parts[1]) == 3 and parts[1].isdigit())
        ):
            raise ProtocolError(f"status line {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return  # an interim response: the real one follows (the state stays HEAD)
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        connection = headers.get(b"connection", b"").lower()
        self._reusable = b"close" not in connection and (
            parts[0] != b"HTTP/1.0" or b"keep-alive" in connection
        )
        self._response = Response(status)
        if status in (204, 304):  # never a body, whatever the headers say
            self._complete()
        elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self._state = _State.CHUNK_SIZE
        elif b"content-length" in headers:
            length = headers[b"content-length"]
            if not _DIGITS.fullmatch(length):
                raise ProtocolError(f"Content-Length {length[:20]!r}")
            self._remaining = int(length)
            self._state = _State.LENGTH_DATA
            if not self._remaining:
                self._complete()
        else:
            self._reusable = False
            self._state = _State.UNTIL_CLOSE

    def _body(self) -> None:
        """Hands over the body bytes parsed so far."""
        if not self._pieces:
            return
        data = b"".join(self._pieces)
        self._pieces.clear()
        response = self._response
        if response.status != 200:
            room = MAX_ERROR_BODY - len(response.error_body)
            if room > 0:
                response.error_body += data[:room]
            return
        if self._stopped:
            return  # read only to reuse the connection
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        if lines and self._sink(lines):
            self._stopped = True

    def _finish_lines(self) -> None:
        self._body()
        if self._pending and not self._stopped and self._response.status == 200:
            self._sink([self._pending])
        self._pending = b""

    def _complete(self) -> None:
        self._state, self._sink = _State.DONE, None
        self.idle_since = time.monotonic()
        if not self._done.done():
            self._done.set_result(self._response)
        if self._reusable and not self.closed:
            self._release(self)
        else:
            self.close()


class StreamingClient:
    """POSTs to one server, each response's body handed over line by line."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        timeout_s: float = 600.0,
        keepalive_s: float = 4.0,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(
                f"--base-url must be http://HOST[:PORT] or https://..., got {base_url!r}"
            )
        if url.username or url.password or url.query or url.fragment:
            raise ValueError(
                f"--base-url {base_url!r}: no credentials, query or fragment "
                "(a key goes in --api-key)"
            )
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.prefix = url.path.rstrip("/")
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        default_port = self.port == (443 if self.ssl else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        fixed = {"Host": host if default_port else f"{host}:{self.port}"}
        fixed.update({"User-Agent": "pdserve-bench", **(headers or {})})
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def post(self, path: str, body: bytes, content_type: str, sink: LineSink) -> Response:
        """Sends the request and returns when its response has ended or the sink
        said stop; a 200's body goes to ``sink`` in complete lines (ending b"\\n"
        taken off; the last line too, when the body does not end with one).
        Raises TimeoutError after ``timeout_s``; ConnectionError, OSError or
        ProtocolError on a lost or bad connection; what the sink raised."""
        raw = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n".encode("latin-1")
            + self._head
            + f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode(
                "latin-1"
            )
            + body
        )
        conn = request = None
        try:
            async with asyncio.timeout(self.timeout_s):
                conn = await self._acquire()
                request = conn.request(raw, sink)
                response = await request
        except BaseException:
            if request is not None:
                conn.abandon(request)
            elif conn is not None:
                conn.close()
            raise
        if not conn.reusable and not conn.closed:
            # Answered early: the rest of the response has this long to end.
            asyncio.get_running_loop().call_later(self.keepalive_s, conn.expire, request)
        return response

    async def _acquire(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Connection(self._idle.append, self._open.discard),
            self.host,
            self.port,
            ssl=self.ssl,
        )
        self._open.add(conn)
        return conn

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run
