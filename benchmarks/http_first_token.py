"""The time to a streamed completion's first event over HTTP, three ways: a bare
socket, aiohttp, and `pdserve bench serve`'s own client. benchmarks/router_relay.py
measures each against the router's gRPC path, so what a client library adds to a
TTFT shows beside what the router adds."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable


class RawHttp:
    """A bare HTTP/1.1 client on one kept-alive connection (TCP_NODELAY): the
    time to the first SSE event with no client library's own cost in it."""

    def __init__(self, port: int, body: bytes) -> None:
        self.port = port
        head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        self.request = head.encode() + body
        self.reader = self.writer = None

    async def first_event(self) -> float:
        import socket

        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
            self.writer.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        start = time.perf_counter()
        self.writer.write(self.request)
        first, seen = None, b""
        # A streamed response ends with [DONE] and the chunked encoding's last chunk.
        while not (b"data: [DONE]" in seen and seen.endswith(b"0\r\n\r\n")):
            chunk = await self.reader.read(65536)
            if not chunk:
                raise RuntimeError("the router closed the HTTP connection")
            seen += chunk
            if first is None and b"data: {" in seen:
                first = time.perf_counter() - start
        return first

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class HttpPaths:
    """label -> a coroutine timing one one-token request to the first event."""

    def __init__(self, port: int, prompt: list[int]) -> None:
        import aiohttp

        from pdserve.bench.backends import OpenAIBackend, SamplingOptions
        from pdserve.bench.datasets import BenchRequest

        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True}
        self.raw = RawHttp(port, json.dumps(body).encode())
        self.session = aiohttp.ClientSession()
        self.bench = OpenAIBackend(f"http://127.0.0.1:{port}", SamplingOptions())
        url = f"http://127.0.0.1:{port}/v1/completions"
        one = BenchRequest(prompt, len(prompt), 1)

        async def via_aiohttp() -> float:  # as `pdserve bench serve` read a stream before
            start = time.perf_counter()
            first = None
            async with self.session.post(url, json=body) as response:
                async for line in response.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - start
            return first

        async def via_bench() -> float:  # `pdserve bench serve`'s own client
            result = await self.bench.send(one)
            if not result.success:
                raise RuntimeError(f"bench client: {result.error}")
            return result.ttft_s

        self.paths: dict[str, Callable[[], Awaitable[float]]] = {
            "router-http-raw": self.raw.first_event,
            "router-http-aiohttp": via_aiohttp,
            "router-http-bench": via_bench,
        }

    async def close(self) -> None:
        self.raw.close()
        await self.session.close()
        await self.bench.close()
