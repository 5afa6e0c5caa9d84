"""--http-keep-alive-s: how long the OpenAI HTTP port keeps an idle keep-alive
connection (real uvicorn servers in-process, from make_server; no cluster
needed for /health), and the flag's refusals."""

from __future__ import annotations

import argparse
import asyncio
import http.client
import time
from types import SimpleNamespace

import pytest

from common.tls import TLSConfig
from pdserve.redis_server import free_port
from router.http.app import HttpStats, build_app, make_server
from router.main import HTTP_KEEP_ALIVE_S, add_arguments

# Past uvicorn's own default (5 s), the value that lost requests.
IDLE_S = 6.0


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def idle_then_health(port: int, wait_s: float) -> tuple[float | None, int | None]:
    """One GET /health, then up to wait_s idle on the same connection: the seconds
    until the server closed it (None: still open), and the status of a second GET
    on that same connection when it is still open."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200 and not first.will_close
        sock = conn.sock
        sock.settimeout(wait_s)
        start = time.monotonic()
        try:
            # Nothing is due from the server: b"" is its close, a timeout its patience.
            assert sock.recv(1) == b""
            return time.monotonic() - start, None
        except TimeoutError:
            pass
        sock.settimeout(10)
        conn.request("GET", "/health")
        assert conn.sock is sock  # the same connection, not a new one
        second = conn.getresponse()
        second.read()
        return None, second.status
    finally:
        conn.close()


def test_idle_connections_outlive_uvicorns_default_and_follow_the_flag(monkeypatch):
    monkeypatch.delenv("PDSERVE_HTTP_KEEP_ALIVE_S", raising=False)
    servicer = SimpleNamespace(frontend=SimpleNamespace(model_id="m", tokenizer=None))
    tls = TLSConfig.from_paths()
    servers = {}
    for keep_alive_s in (parse().http_keep_alive_s, 1):  # the flag's default, and 1 s
        port = free_port()
        app = build_app(servicer, None, HttpStats())
        servers[port] = make_server(app, "127.0.0.1", port, tls, 1, keep_alive_s)

    async def scenario():
        tasks = [asyncio.ensure_future(s.serve()) for s in servers.values()]
        while not all(s.started for s in servers.values()):
            await asyncio.sleep(0.01)
        try:
            # Both at once: the test takes IDLE_S, not twice that.
            return await asyncio.gather(
                *(asyncio.to_thread(idle_then_health, port, IDLE_S) for port in servers)
            )
        finally:
            for s in servers.values():
                s.should_exit = True
            await asyncio.gather(*tasks)

    (default_closed, default_status), (short_closed, short_status) = asyncio.run(scenario())
    # Default (65 s): still open after IDLE_S, and the next request on it is answered.
    assert default_closed is None and default_status == 200
    # 1 s: the server closed the idle connection after about 1 s.
    assert short_closed is not None and 0.5 <= short_closed <= 3.0, short_closed
    assert short_status is None


def test_flag_defaults_to_65_and_follows_the_variable(monkeypatch):
    monkeypatch.delenv("PDSERVE_HTTP_KEEP_ALIVE_S", raising=False)
    assert parse().http_keep_alive_s == HTTP_KEEP_ALIVE_S == 65
    assert parse("--http-keep-alive-s", "120").http_keep_alive_s == 120
    monkeypatch.setenv("PDSERVE_HTTP_KEEP_ALIVE_S", "75")
    assert parse().http_keep_alive_s == 75
    monkeypatch.setenv("PDSERVE_HTTP_KEEP_ALIVE_S", "")  # empty: the default
    assert parse().http_keep_alive_s == 65


@pytest.mark.parametrize("bad", ["0", "-5", "1.5", "abc", ""])
def test_flag_refuses_what_is_not_a_whole_positive_number(bad, monkeypatch, capsys):
    monkeypatch.delenv("PDSERVE_HTTP_KEEP_ALIVE_S", raising=False)
    message = (
        f"argument --http-keep-alive-s: must be a whole number of seconds, at least 1, got {bad!r}"
    )
    with pytest.raises(SystemExit) as info:
        parse("--http-keep-alive-s", bad)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
    if not bad:
        return  # an empty variable means the default (above)
    # A bad variable is the same usage error, naming the flag.
    monkeypatch.setenv("PDSERVE_HTTP_KEEP_ALIVE_S", bad)
    with pytest.raises(SystemExit) as info:
        parse()
    assert info.value.code == 2
    assert message in capsys.readouterr().err
