"""The load generator's HTTP/1.1 client (pdserve/bench/http_stream.py) against
real asyncio servers on loopback that answer with exact bytes: chunked bodies
cut anywhere, lengths, errors, interim responses, closes, keep-alive."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.http_stream import ProtocolError, StreamingClient


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
    )


SSE = chunked(b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\ndata: [DO', b"NE]\n\n")
SSE_LINES = [b'data: {"a": 1}', b"", b'data: {"b": 2}', b"", b"data: [DONE]", b""]


class Server:
    """Answers each request (read up to its body's end) with ``reply(n)``'s bytes,
    written ``step`` bytes at a time; counts connections and requests."""

    def __init__(self, reply, step: int | None = None, close_after: bool = False) -> None:
        self.reply, self.step, self.close_after = reply, step, close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                self.requests.append(head + await reader.readexactly(length))
                data = self.reply(len(self.requests))
                step = self.step or len(data) or 1
                for i in range(0, len(data), step):
                    writer.write(data[i : i + step])
                    await writer.drain()
                    if self.step:
                        await asyncio.sleep(0)
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def post(client: StreamingClient, body: bytes = b"{}"):
    lines: list[bytes] = []
    resp = await client.post("/v1/completions", body, "application/json", lines.extend)
    return resp, lines


@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_a_chunked_stream_arrives_as_its_lines_however_it_is_cut(step):
    async def go():
        server = Server(lambda n: SSE, step=step)
        async with server as url:
            client = StreamingClient(url + "/", {"Authorization": "Bearer t"})
            try:
                resp, lines = await post(client, b'{"x": 1}')
            finally:
                await client.close()
        return resp, lines, server.requests[0]

    resp, lines, request = asyncio.run(go())
    assert resp.status == 200 and resp.error_body == b""
    assert lines == SSE_LINES
    head, _, body = request.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer t" in head and b"\r\nContent-Length: 8" in head
    assert body == b'{"x": 1}'


def test_lengths_errors_and_interim_responses():
    replies = {
        1: b"HTTP/1.1 100 Continue\r\n\r\n"
        + b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab\ncd\nlast",
        2: b'HTTP/1.1 400 Bad Request\r\nContent-Length: 12\r\n\r\n{"error": 1}',
        3: b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    }

    async def go():
        server = Server(lambda n: replies[n])
        async with server as url:
            client = StreamingClient(url)
            try:
                return [await post(client) for _ in range(3)], server.connections
            finally:
                await client.close()

    (ok, bad, empty), connections = asyncio.run(go())
    assert ok[0].status == 200 and ok[1] == [b"ab", b"cd", b"last"]  # the unended last line too
    assert bad[0].status == 400 and bad[0].error_body == b'{"error": 1}' and bad[1] == []
    assert empty[0].status == 200 and empty[1] == []
    assert connections == 1  # kept alive across all three


def test_a_body_that_ends_with_the_connection():
    reply = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\ndata: x\n\ndata: [DONE]"

    async def go():
        server = Server(lambda n: reply, close_after=True)
        async with server as url:
            client = StreamingClient(url)
            try:
                first = await post(client)
                second = await post(client)  # the first connection is gone: a new one
            finally:
                await client.close()
        return first, second, server.connections

    (resp, lines), second, connections = asyncio.run(go())
    assert resp.status == 200 and lines == [b"data: x", b"", b"data: [DONE]"]
    assert second[1] == lines and connections == 2


def test_no_connection_idle_past_keepalive_is_reused():
    async def go():
        server = Server(lambda n: SSE)
        async with server as url:
            client = StreamingClient(url, keepalive_s=0.2)
            try:
                await post(client)
                await post(client)  # reused
                reused = server.connections
                await asyncio.sleep(0.3)
                await post(client)  # idle too long: a new connection
                return reused, server.connections
            finally:
                await client.close()

    assert asyncio.run(go()) == (1, 2)


@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nda", ConnectionError, "mid"),
        (b"", ConnectionError, "before answering"),
        (b"SMTP ready\r\n\r\n", ProtocolError, "status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", ProtocolError, "bad"),
    ],
)
def test_a_lost_or_garbled_response_fails_the_request(reply, error, match):
    async def go():
        async with Server(lambda n: reply, close_after=True) as url:
            client = StreamingClient(url)
            try:
                await post(client)
            finally:
                await client.close()

    with pytest.raises(error, match=match):
        asyncio.run(go())


def test_a_silent_server_times_out_and_a_failing_sink_fails_only_its_request():
    async def silent(reader, writer):
        await reader.read(1)
        await asyncio.sleep(5)

    def explode(lines):
        raise KeyError("the sink's own error")

    async def go():
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = StreamingClient(url, timeout_s=0.3)
        try:
            with pytest.raises(TimeoutError):
                await post(client)
        finally:
            await client.close()
            server.close()
        async with Server(lambda n: SSE) as url:
            client = StreamingClient(url)
            try:
                with pytest.raises(KeyError, match="sink's own"):
                    await client.post("/x", b"", "application/json", explode)
                return await post(client)  # the next request is served as usual
            finally:
                await client.close()

    resp, lines = asyncio.run(go())
    assert resp.status == 200 and lines == SSE_LINES


def test_bad_base_urls_are_refused():
    with pytest.raises(ValueError, match="--base-url"):
        StreamingClient("127.0.0.1:8000")
    assert StreamingClient("https://example.test").port == 443
