"""A scripted fake OpenAI completions server, for testing and sizing `pdserve bench serve`.

    python benchmarks/support/serve_fake_server.py --port 8000 [--ttft-ms 0] [--itl-ms 0]

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
import subprocess
import sys
import time
import urllib.request
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

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counts)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/stats", stats)
    app[COUNTS] = counts
    return app


class FakeServer:
    """The fake on a real port in its own process (tests): its event loop must
    not share a GIL with the client's, whose timings the tests check."""

    def __init__(self, default: Script | None = None) -> None:
        from pdserve.redis_server import free_port  # the script itself runs without pdserve

        self.default = default or Script()
        self.port = free_port()
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> int:
        """Completions requests received so far."""
        with urllib.request.urlopen(self.base_url + "/stats", timeout=10) as r:
            return json.loads(r.read())["requests"]

    def __enter__(self) -> FakeServer:
        self._proc = subprocess.Popen(
            [sys.executable, __file__, "--port", str(self.port)]
            + [
                "--ttft-ms",
                str(self.default.ttft_s * 1e3),
                "--itl-ms",
                str(self.default.itl_s * 1e3),
            ]
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.requests()
                return self
            except OSError:
                time.sleep(0.1)
        self._proc.kill()
        raise RuntimeError("the fake server did not start")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    args = p.parse_args()
    app = make_app(Script(args.ttft_ms / 1e3, args.itl_ms / 1e3))
    # uvloop where installed: sizing the generator needs a fake that outruns it,
    # and on asyncio's loop this one topped out at about 2,000 requests/s on one
    # core, below the generator (docs/lab/2026-11-26-load-generator-capacity.md).
    try:
        import uvloop
    except ImportError:
        uvloop = None
    loop = uvloop.new_event_loop() if uvloop is not None else None
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, loop=loop)


if __name__ == "__main__":
    main()
