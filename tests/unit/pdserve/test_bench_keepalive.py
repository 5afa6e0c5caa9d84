"""`pdserve bench serve`'s HTTP client drops pooled connections before a
uvicorn-based server (vLLM, pdserve's HTTP edge at uvicorn's default) closes
them for idleness, so no request is lost to that race (pdserve/bench/backends.py)."""

from __future__ import annotations

import asyncio

from pdserve.bench.backends import KEEPALIVE_S, OpenAIBackend, SamplingOptions

UVICORN_DEFAULT_KEEP_ALIVE_S = 5


def test_openai_backend_reuses_no_connection_idle_past_uvicorns_keep_alive():
    async def keepalive_timeout() -> float | None:
        backend = OpenAIBackend("http://127.0.0.1:1", SamplingOptions())
        try:
            # No public accessor: what BaseConnector._get compares idle time against.
            return backend.session.connector._keepalive_timeout
        finally:
            await backend.close()

    assert asyncio.run(keepalive_timeout()) == KEEPALIVE_S < UVICORN_DEFAULT_KEEP_ALIVE_S
