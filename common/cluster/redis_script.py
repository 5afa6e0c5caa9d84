"""The routing read's own connection to Redis: one script, pipelined, parsed by hiredis.

A routing decision is one EVALSHA. Through redis-py's asyncio client that
command cost the router Python beyond the round trip itself (connection pool,
retry wrapper, the parser's reads from a stream), on every request; written
straight to a socket, its reply parsed by hiredis in the protocol's callback,
the same round trip is markedly shorter
(docs/lab/2026-11-25-router-own-path.md). Everything else -- heartbeats,
operator commands, the start-up check -- stays on redis-py.

The connection is opened from the redis-py client's own settings (host and
port or unix socket, db, user and password, TLS through redis-py's own SSL
context, so with the same CA and host-name checks), lazily, and again after
any failure. Requests are pipelined and their replies come back in order. A
reply that is not back within the client's socket timeout fails every request
on the connection, which is closed: after a reply is skipped the order is
lost. For settings it does not handle, ``ScriptConnection.for_client`` returns
None and the caller goes through redis-py.

``send`` writes a call at once and ``finish`` awaits its reply, so that a
caller can do other work during the round trip (the router validates a
request meanwhile); a call whose reply nobody awaits is dropped quietly.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

import hiredis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

# The redis-py connection settings honoured here (ssl_* through SSLConnection's context).
_HANDLED = {"host", "port", "path", "db", "username", "password"}
_HANDLED |= {"socket_timeout", "socket_connect_timeout"}
# redis-py's own bookkeeping, which changes nothing on the wire.
_IGNORED = {"himport_registry", "maint_notifications_pool_handler", "maint_notifications_config"}
_IGNORED |= {"orig_host_address", "orig_socket_timeout", "orig_socket_connect_timeout"}
# redis-py's retries: here a failed connection is reopened by the next call.
_IGNORED |= {"retry", "retry_on_error"}


def pack_command(args: tuple) -> bytes:
    """One command in RESP: str, bytes and int arguments."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, int):
            arg = b"%d" % arg
        out += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(out)


class _Replies(asyncio.Protocol):
    """One connection: each reply completes the oldest request still waiting."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = hiredis.Reader(replyError=ResponseError)
        self.waiting: deque[asyncio.Future] = deque()
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        while (reply := self.parser.gets()) is not False:
            if not self.waiting:
                self.fail(RedisConnectionError("Redis sent a reply nobody asked for"))
                return
            waiter = self.waiting.popleft()
            if not waiter.done():  # its caller may have given up (cancelled)
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Redis closed the connection ({exc or 'end of stream'})"))

    def fail(self, error: BaseException) -> None:
        """Every waiting request fails with ``error``; the connection is not used again."""
        if self.lost is None:
            self.lost = error
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def request(self, args: tuple) -> asyncio.Future:
        waiter = asyncio.get_running_loop().create_future()
        # A reply nobody awaits (its caller dropped it) must not be logged as
        # an exception never retrieved.
        waiter.add_done_callback(_retrieved)
        if self.lost is not None:
            waiter.set_exception(self.lost)
            return waiter
        self.waiting.append(waiter)
        self.transport.write(pack_command(args))
        return waiter


def _retrieved(waiter: asyncio.Future) -> None:
    if not waiter.cancelled():
        waiter.exception()


@dataclass(slots=True)
class Sent:
    """An EVALSHA on its way (ScriptConnection.send): what finish() needs."""

    conn: _Replies
    waiter: asyncio.Future
    timer: asyncio.TimerHandle | None
    command: tuple  # numkeys, keys, args


class ScriptConnection:
    """EVALSHA of one script on a connection of its own (module docstring)."""

    def __init__(self, connection: Connection, settings: dict[str, Any]) -> None:
        self._template = connection  # redis-py's, never connected: its address and TLS
        self.path = settings.get("path")
        self.host, self.port = settings.get("host", "localhost"), settings.get("port", 6379)
        self.db = int(settings.get("db") or 0)
        self.username, self.password = settings.get("username"), settings.get("password")
        self.timeout = settings.get("socket_timeout")
        self.connect_timeout = settings.get("socket_connect_timeout") or self.timeout
        self._conn: _Replies | None = None
        self._opening = asyncio.Lock()
        self.sent = 0  # commands written (the benchmarks count round trips)

    @classmethod
    def for_client(cls, client: Any) -> ScriptConnection | None:
        """One for ``client``'s server and settings; None when they are not all handled here."""
        pool = getattr(client, "connection_pool", None)
        if pool is None or pool.connection_class not in (
            Connection,
            SSLConnection,
            UnixDomainSocketConnection,
        ):
            return None
        settings = dict(pool.connection_kwargs)
        for key, value in settings.items():
            handled = key in _HANDLED or key in _IGNORED or key.startswith("ssl_")
            if not handled and value not in (None, False):
                return None
        return cls(pool.make_connection(), settings)

    async def _connection(self) -> _Replies:
        conn = self._conn
        if conn is not None and conn.lost is None:
            return conn
        async with self._opening:
            if self._conn is None or self._conn.lost is not None:
                self._conn = await self._open()
            return self._conn

    async def _open(self) -> _Replies:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            if self.path:
                _, conn = await loop.create_unix_connection(_Replies, self.path)
            else:
                tls = None
                if isinstance(self._template, SSLConnection):
                    tls = self._template.ssl_context.get()
                _, conn = await loop.create_connection(
                    _Replies,
                    self.host,
                    self.port,
                    ssl=tls,
                    server_hostname=self.host if tls is not None else None,
                )
            try:
                if self.password:
                    user = (self.username,) if self.username else ()
                    await self._checked(conn, ("AUTH", *user, self.password))
                if self.db:
                    await self._checked(conn, ("SELECT", self.db))
            except BaseException:
                conn.fail(RedisConnectionError("connection set-up failed"))
                raise
        return conn

    async def _checked(self, conn: _Replies, args: tuple) -> Any:
        reply = await self._call(conn, args)
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def _call(self, conn: _Replies, args: tuple) -> Any:
        waiter = conn.request(args)
        self.sent += 1
        if self.timeout is None:
            return await waiter
        timer = asyncio.get_running_loop().call_later(self.timeout, self._expire, conn, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()

    def _expire(self, conn: _Replies, waiter: asyncio.Future) -> None:
        if not waiter.done():
            conn.fail(RedisTimeoutError(f"no reply from Redis within {self.timeout} s"))

    async def evalsha(self, sha: str, script: str, keys: list[str], args: list[Any]) -> Any:
        """The script's reply (raw, as redis-py returns it); raises redis-py's exceptions."""
        await self._connection()
        return await self.finish(self.send(sha, keys, args), script)

    def send(self, sha: str, keys: list[str], args: list[Any]) -> Sent | None:
        """EVALSHA written now; None while the connection is not open (use evalsha)."""
        conn = self._conn
        if conn is None or conn.lost is not None:
            return None
        command = (len(keys), *keys, *args)
        waiter = conn.request(("EVALSHA", sha, *command))
        self.sent += 1
        timer = None
        if self.timeout is not None:
            timer = asyncio.get_running_loop().call_later(self.timeout, self._expire, conn, waiter)
        return Sent(conn, waiter, timer, command)

    async def finish(self, sent: Sent | None, script: str) -> Any:
        """The reply to ``send``'s call (``script``: its source, for a Redis that lost it)."""
        if sent is None:  # the connection failed between _connection() and send()
            raise RedisConnectionError("the routing connection to Redis is closed")
        try:
            reply = await sent.waiter
        finally:
            if sent.timer is not None:
                sent.timer.cancel()
        if isinstance(reply, ResponseError) and str(reply).startswith("NOSCRIPT"):
            # A restarted or flushed Redis: EVAL runs the script and caches it again.
            reply = await self._call(sent.conn, ("EVAL", script, *sent.command))
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    def close(self) -> None:
        if self._conn is not None:
            self._conn.fail(RedisConnectionError("closed"))
