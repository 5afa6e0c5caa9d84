"""The OpenAI HTTP port takes the gRPC port's TLS flags: HTTPS, and mTLS with
--tls-client-ca (a real uvicorn server in-process; no cluster needed for /health)."""

from __future__ import annotations

import asyncio
import http.client
import ssl
from types import SimpleNamespace

import pytest

from common.tls import TLSConfig
from pdserve.redis_server import free_port
from router.http.app import HttpStats, build_app, make_server
from tests.certs import make_certs


def get_health(port: int, context: ssl.SSLContext) -> int:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def test_https_with_client_certificates(tmp_path):
    certs = make_certs(tmp_path)
    tls = TLSConfig.from_paths(cert=certs.cert, key=certs.key, client_ca=certs.ca)
    servicer = SimpleNamespace(frontend=SimpleNamespace(model_id="m", tokenizer=None))
    port = free_port()
    app = build_app(servicer, None, HttpStats())
    server = make_server(app, "127.0.0.1", port, tls, 1, keep_alive_s=5)

    trusted = ssl.create_default_context(cafile=str(certs.ca))
    trusted.load_cert_chain(str(certs.cert), str(certs.key))
    no_client_cert = ssl.create_default_context(cafile=str(certs.ca))
    stranger_ca = ssl.create_default_context(cafile=str(certs.other_ca))
    stranger_ca.load_cert_chain(str(certs.cert), str(certs.key))

    async def scenario():
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            assert await asyncio.to_thread(get_health, port, trusted) == 200
            # No client certificate: the handshake (or the first read) fails.
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await asyncio.to_thread(get_health, port, no_client_cert)
            # The server's certificate is not signed by the client's CA.
            with pytest.raises(ssl.SSLCertVerificationError):
                await asyncio.to_thread(get_health, port, stranger_ca)
        finally:
            server.should_exit = True
            await task

    asyncio.run(scenario())
