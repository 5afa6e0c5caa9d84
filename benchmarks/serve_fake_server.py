"""A scripted fake OpenAI completions server, for testing and sizing `pdserve bench serve`.

    python benchmarks/serve_fake_server.py --port 8000 [--ttft-ms 0] [--itl-ms 0]

``POST /v1/completions`` with ``stream: true`` answers ``max_tokens`` tokens,
one SSE chunk each, the first after the TTFT delay and the next ones each after
the ITL delay, then a usage chunk (when ``stream_options.include_usage``) and
``data: [DONE]``. A text prompt can script its own request: words
``ttft=S``, ``itl=S`` (seconds) and ``fail=1`` (HTTP 500) override the defaults,
so one test can mix fast, slow and failing requests with known timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
from dataclasses import dataclass

from aiohttp import web

COUNTS = web.AppKey("counts", dict)


@dataclass(slots=True)
class Script:
    ttft_s: float = 0.0
    itl_s: float = 0.0


def _overrides(prompt: object, base: Script) -> tuple[Script, bool]:
    s = Script(base.ttft_s, base.itl_s)
    fail = False
    if isinstance(prompt, str):
        for word in prompt.split():
            key, _, value = word.partition("=")
            if key == "ttft":
                s.ttft_s = float(value)
            elif key == "itl":
                s.itl_s = float(value)
            elif key == "fail":
                fail = value == "1"
    return s, fail


def make_app(default: Script) -> web.Application:
    counts = {"requests": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        counts["requests"] += 1
        script, fail = _overrides(body.get("prompt"), default)
        if fail:
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        n = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt")
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(script.ttft_s if i == 0 else script.itl_s)
            choice = {"index": 0, "text": f"t{i} ", "finish_reason": None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [1000 + i]
            if i == n - 1:
                choice["finish_reason"] = "length"
            chunk = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
            usage["total_tokens"] = prompt_tokens + n
            chunk = {"id": "cmpl-fake", "object": "text_completion", "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app[COUNTS] = counts
    return app


class FakeServer:
    """The fake on a real port, in a background thread (tests)."""

    def __init__(self, default: Script | None = None) -> None:
        self.default = default or Script()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self.app = make_app(self.default)
        self._runner = web.AppRunner(self.app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.SockSite(self._runner, self._sock)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> FakeServer:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fake server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    args = p.parse_args()
    app = make_app(Script(args.ttft_ms / 1e3, args.itl_ms / 1e3))
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
