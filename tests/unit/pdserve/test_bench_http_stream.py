"""The load generator's HTTP/1.1 client (pdserve/bench/http_stream.py) against
real asyncio servers on loopback that answer with exact bytes: chunked bodies
cut anywhere, lengths, errors, interim responses, closes, keep-alive."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from pdserve.bench.backends import OpenAIBackend, SamplingOptions
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.http_stream import ProtocolError, StreamingClient

try:
    import uvloop
except ImportError:  # the generator then runs on asyncio's loop only
    uvloop = None

LOOPS = ["asyncio"] + (["uvloop"] if uvloop is not None else [])


def run(coro, loop: str = "asyncio"):
    """``coro`` on the named event loop (the generator runs on uvloop where installed)."""
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def chunk(piece: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(chunk(p) for p in pieces)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
    )


SSE = chunked(b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\ndata: [DO', b"NE]\n\n")
SSE_LINES = [b'data: {"a": 1}', b"", b'data: {"b": 2}', b"", b"data: [DONE]", b""]


@contextlib.asynccontextmanager
async def raw_server(handler):
    """A loopback server running ``handler(reader, writer)`` per connection; its URL."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


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
        self._running = raw_server(self.handle)
        return await self._running.__aenter__()

    async def __aexit__(self, *exc) -> None:
        await self._running.__aexit__(*exc)


async def post(client: StreamingClient, body: bytes = b"{}"):
    lines: list[bytes] = []
    resp = await client.post("/v1/completions", body, "application/json", lines.extend)
    return resp, lines


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("step", [None, 1, 3, 7])
def test_a_chunked_stream_arrives_as_its_lines_however_it_is_cut(step, loop):
    async def go():
        server = Server(lambda n: SSE, step=step)
        async with server as url:
            client = StreamingClient(url + "/", {"Authorization": "Bearer t"})
            try:
                resp, lines = await post(client, b'{"x": 1}')
            finally:
                await client.close()
        return resp, lines, server.requests[0]

    resp, lines, request = run(go(), loop)
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
        # No body, whatever the headers say; and a kept-alive server never closes.
        4: b"HTTP/1.1 204 No Content\r\n\r\n",
        5: b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
    }

    async def go():
        server = Server(lambda n: replies[n])
        async with server as url:
            client = StreamingClient(url)
            try:
                return [await post(client) for _ in range(5)], server.connections
            finally:
                await client.close()

    (ok, bad, empty, none, unmodified), connections = asyncio.run(go())
    assert ok[0].status == 200 and ok[1] == [b"ab", b"cd", b"last"]  # the unended last line too
    assert bad[0].status == 400 and bad[0].error_body == b'{"error": 1}' and bad[1] == []
    assert empty[0].status == 200 and empty[1] == []
    assert none[0].status == 204 and unmodified[0].status == 304 and none[1] == []
    assert connections == 1  # kept alive across all five


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


@pytest.mark.parametrize("loop", LOOPS)
def test_no_connection_idle_past_keepalive_is_reused(loop):
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

    assert run(go(), loop) == (1, 2)


@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nda", ConnectionError, "mid"),
        (b"", ConnectionError, "before answering"),
        (b"SMTP ready\r\n\r\n", ProtocolError, "status line"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", ProtocolError, "size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\n", ProtocolError, "size"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", ProtocolError, "Length"),
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
        async with raw_server(silent) as url:
            client = StreamingClient(url, timeout_s=0.3)
            try:
                with pytest.raises(TimeoutError):
                    await post(client)
            finally:
                await client.close()
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


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
DONE_FIRST = CHUNKED_HEAD + chunk(b"data: [DONE]\n\n")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_sink_that_stops_is_answered_at_once_and_the_rest_only_reuses_the_connection(loop):
    """The stream's end (data: [DONE]) answers the request; the rest of the
    response, late, cut short or never, decides nothing about it."""
    sent: list[str] = []

    async def server(reader, writer):
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)  # the body: {}
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(DONE_FIRST)
            await writer.drain()
            how = sent[len(sent) - 1]
            if how == "late end":
                await asyncio.sleep(0.1)
                writer.write(b"0\r\n\r\n")
            elif how == "drop":
                writer.close()
                return
            elif how == "stall":
                await asyncio.sleep(1.0)
                writer.close()
                return

    def stop_at_done(got):
        def sink(lines):
            got.extend(lines)
            return b"data: [DONE]" in lines

        return sink

    async def one(client, how):
        sent.append(how)
        got: list[bytes] = []
        start = time.perf_counter()
        resp = await client.post("/x", b"{}", "application/json", stop_at_done(got))
        return resp.status, got, time.perf_counter() - start

    async def go():
        async with raw_server(server) as url:
            client = StreamingClient(url, keepalive_s=0.3)
            try:
                late = await one(client, "late end")
                await asyncio.sleep(0.2)  # the end came: the connection is back in the pool
                reused = len(client._open)
                after = await one(client, "drop")
                stalled = await one(client, "stall")
                await asyncio.sleep(0.5)  # past keepalive_s: the stalled one is closed
                return late, reused, after, stalled, len(client._open)
            finally:
                await client.close()

    late, reused, after, stalled, still_open = run(go(), loop)
    for status, got, seconds in (late, after, stalled):
        assert status == 200 and got == [b"data: [DONE]", b""] and seconds < 0.09
    assert reused == 1 and still_open == 0


def test_the_sink_is_not_fed_after_its_request_failed_and_its_errors_are_its_own():
    calls: list[list[bytes]] = []

    async def partial(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\ndata: first\ndata: no newline yet")
        await asyncio.sleep(2)
        writer.close()

    async def go():
        async with raw_server(partial) as url:
            client = StreamingClient(url, timeout_s=0.3)
            try:
                with pytest.raises(TimeoutError):
                    await client.post("/x", b"", "application/json", calls.append)
                await asyncio.sleep(0.1)  # the close runs its callbacks
            finally:
                await client.close()
        async with Server(lambda n: SSE) as url:
            client = StreamingClient(url)
            try:

                def bad_json(lines):
                    raise ValueError("the sink's own ValueError")

                with pytest.raises(ValueError, match="sink's own") as raised:
                    await client.post("/x", b"", "application/json", bad_json)
                assert type(raised.value) is ValueError  # not a ProtocolError
            finally:
                await client.close()

    asyncio.run(go())
    assert calls == [[b"data: first"]]  # the unfinished line never reached the sink


def test_the_backend_keeps_the_streams_own_end_and_error():
    """An error event followed by silence is that error, at once; a complete
    stream whose connection drops before the body's last chunk is a success."""
    error_then_stall = CHUNKED_HEAD + chunk(b'data: {"error": {"message": "engine died"}}\n\n')
    done_then_drop = (
        CHUNKED_HEAD
        + chunk(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        + chunk(b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n')
        + chunk(b"data: [DONE]\n\n")
    )

    async def go(reply, hold):
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            await asyncio.sleep(hold)
            writer.close()

        async with raw_server(serve) as url:
            backend = OpenAIBackend(url, SamplingOptions(timeout_s=5))
            try:
                start = time.perf_counter()
                out = await backend.send(BenchRequest([1, 2], 2, 1))
                return out, time.perf_counter() - start
            finally:
                await backend.close()

    failed, seconds = asyncio.run(go(error_then_stall, 3))
    assert not failed.success and "engine died" in failed.error and seconds < 1
    ok, _ = asyncio.run(go(done_then_drop, 0))
    assert ok.success and ok.output_tokens == 1 and ok.text == "a" and ok.error == ""
