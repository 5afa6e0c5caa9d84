"""`pdserve bench serve`'s HTTP client drops pooled connections before a
uvicorn-based server (vLLM, pdserve's HTTP edge at uvicorn's default) closes
them for idleness, so no request is lost to that race (pdserve/bench/backends.py;
the pool's behaviour: tests/unit/pdserve/test_bench_http_stream.py)."""

from __future__ import annotations

from pdserve.bench.backends import KEEPALIVE_S, OpenAIBackend, SamplingOptions

UVICORN_DEFAULT_KEEP_ALIVE_S = 5


def test_openai_backend_reuses_no_connection_idle_past_uvicorns_keep_alive():
    backend = OpenAIBackend("http://127.0.0.1:1", SamplingOptions())
    assert backend.client.keepalive_s == KEEPALIVE_S < UVICORN_DEFAULT_KEEP_ALIVE_S
