"""Backends: one streamed request in, its timings and tokens out.

OpenAI HTTP: ``POST {base_url}/v1/completions`` with ``stream: true``; Server-Sent
Events ``data: {json}`` lines ending ``data: [DONE]`` (any OpenAI-compatible
server: pdserve's HTTP edge, vLLM, SGLang). pdserve gRPC: Router.Generate.

Timings follow ``vllm bench serve``: TTFT is send to the first chunk with
output; ITL is the gap between later chunks with output (one entry per chunk, a
chunk may carry several tokens); latency is send to the end of the stream.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.bench.datasets import BenchRequest
from pdserve.bench.http_stream import StreamingClient


class BackendKind(enum.Enum):
    OPENAI = "openai"
    GRPC = "grpc"

    def __str__(self) -> str:  # argparse shows choices by str()
        return self.value


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    start_s: float = 0.0  # perf_counter at send
    output_ids: list[int] = field(default_factory=list)  # when the server gives them
    cached_tokens: int = 0
    text: str = ""
    # Where the server says its first token went (pdserve over gRPC: Usage.timing),
    # on the node that computed the prompt: queued, then prefilled. None: not said.
    server_queue_s: float | None = None
    server_prefill_s: float | None = None


class Backend(Protocol):
    async def send(self, req: BenchRequest) -> RequestResult: ...
    async def close(self) -> None: ...


@dataclass(slots=True)
class SamplingOptions:
    model: str = ""
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout_s: float = 600.0
    # Ask for the reply's token ids (vLLM's return_token_ids): multi-turn needs them.
    want_token_ids: bool = False


class _Timer:
    """Marks the first output and the gaps after it."""

    __slots__ = ("last", "out", "start")

    def __init__(self, out: RequestResult) -> None:
        self.out = out
        self.start = self.last = out.start_s = time.perf_counter()

    def chunk(self) -> None:
        now = time.perf_counter()
        if self.out.ttft_s == 0.0:
            self.out.ttft_s = now - self.start
        else:
            self.out.itl_s.append(now - self.last)
        self.last = now

    def end(self) -> None:
        self.out.latency_s = time.perf_counter() - self.start


# A pooled connection idle longer than this is closed instead of reused (checked when
# one is handed out). Below the 5 s keep-alive timeout of uvicorn-based servers (vLLM,
# pdserve's HTTP edge before --http-keep-alive-s): reusing a connection just as the
# server closes it for idleness loses the request (connection reset; a POST is not
# retried), a failure that would be charged to whichever server is measured. A new
# connection costs a handshake, no more.
KEEPALIVE_S = 4.0


# json.loads without its per-call type checks and encoding detection (one call per
# streamed token: the generator's largest cost per chunk).
_decode = json.JSONDecoder().decode


class _SSEReader:
    """The events of one streamed completion, fed as whole lines: SSE puts one
    event per ``data: ...`` line, with blank lines and comments between."""

    __slots__ = ("chunks", "done", "out", "timer", "usage")

    def __init__(self, out: RequestResult, timer: _Timer) -> None:
        self.out, self.timer = out, timer
        self.chunks = 0
        self.usage: dict | None = None
        self.done = False  # data: [DONE] came

    def feed(self, lines: list[bytes]) -> bool:
        """Called where the lines arrive (pdserve/bench/http_stream.py), so the
        chunk times are those of their arrival. True once the stream has said all
        it will (``data: [DONE]`` or an error event): the request ends there."""
        out = self.out
        if self.done or out.error:  # the stream has ended: later lines are ignored
            return True
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.timer.end()
                self.done = True
                return True
            obj = _decode(data.decode())
            if "error" in obj:
                out.error = str(obj["error"])[:200]
                return True
            if obj.get("usage"):
                self.usage = obj["usage"]
            if choices := obj.get("choices"):
                # Any chunk with a choice is output, its text empty or not (vllm
                # bench serve's rule): a server without a tokenizer (dummy
                # weights) streams empty texts.
                self.timer.chunk()
                self.chunks += 1
                for choice in choices:
                    out.text += choice.get("text") or ""
                    out.output_ids.extend(choice.get("token_ids") or ())
        return False


def response_format(schema: dict) -> dict:
    """OpenAI's ``response_format`` asking for output that matches ``schema``."""
    return {
        "type": "json_schema",
        "json_schema": {"name": "bench", "schema": schema, "strict": True},
    }


class OpenAIBackend:
    def __init__(self, base_url: str, opts: SamplingOptions, api_key: str | None = None) -> None:
        self.opts = opts
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One connection per request in flight, kept alive: --max-concurrency is the
        # only limit on requests in flight.
        self.client = StreamingClient(base_url, headers, opts.timeout_s, KEEPALIVE_S)

    def body(self, req: BenchRequest) -> dict:
        body = {
            "prompt": req.prompt,
            "max_tokens": req.output_len,
            "temperature": self.opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        model = req.model or self.opts.model
        if model:  # else the server's one model (vLLM, pdserve take no name)
            body["model"] = model
        if self.opts.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extra; pdserve's HTTP edge takes it too
        if self.opts.want_token_ids:
            body["return_token_ids"] = True
        if req.json_schema is not None:  # OpenAI's spelling, which vLLM and pdserve take
            body["response_format"] = response_format(req.json_schema)
        return body

    async def send(self, req: BenchRequest) -> RequestResult:
        out = RequestResult(prompt_len=req.prompt_len)
        timer = _Timer(out)
        sse = _SSEReader(out, timer)
        try:
            body = json.dumps(self.body(req)).encode()
            resp = await self.client.post("/v1/completions", body, "application/json", sse.feed)
        except Exception as e:  # every failure is counted and listed, none dropped
            out.error = f"{type(e).__name__}: {e}"[:200]
            return out
        if resp.status != 200:
            text = resp.error_body.decode(errors="replace")
            out.error = f"HTTP {resp.status}: {text}"[:200]
            return out
        if out.error:  # an error event in the stream
            return out
        if not sse.done:
            timer.end()
            out.error = "the stream ended without data: [DONE]"
            return out
        usage, chunks = sse.usage, sse.chunks
        if usage:
            out.output_tokens = int(usage.get("completion_tokens") or 0)
            out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = int(details.get("cached_tokens") or 0)
        else:
            # No usage (server ignores include_usage): token ids if given, else chunks.
            out.output_tokens = len(out.output_ids) or chunks
        out.success = out.output_tokens > 0
        if not out.success:
            out.error = "no output tokens"
        return out

    async def close(self) -> None:
        await self.client.close()


class GrpcBackend:
    """pdserve's Router.Generate over one shared channel (HTTP/2 multiplexes the streams)."""

    def __init__(self, address: str, opts: SamplingOptions, token: str | None = None) -> None:
        import grpc

        from proto import pdserve_pb2_grpc

        self.opts = opts
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pdserve_pb2_grpc.RouterStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    async def send(self, req: BenchRequest) -> RequestResult:
        import grpc

        out = RequestResult(prompt_len=req.prompt_len)
        request = grpc_request(req, self.opts)
        timer = _Timer(out)
        final = None
        try:
            call = self.stub.Generate(request, timeout=self.opts.timeout_s, metadata=self.metadata)
            async for r in call:
                got = False
                for d in r.deltas:
                    if d.token_ids or d.text:
                        got = True
                        out.output_ids.extend(d.token_ids)
                        out.text += d.text
                if got:
                    timer.chunk()
                if r.HasField("final"):
                    final = r.final
            timer.end()
        except grpc.RpcError as e:
            out.error = f"{e.code().name}: {e.details()}"[:200]
            return out
        except Exception as e:
            out.error = f"{type(e).__name__}: {e}"[:200]
            return out
        if final is None:
            out.error = "the stream ended without a Final message"
            return out
        out.output_tokens = final.usage.completion_tokens
        out.prompt_len = final.usage.prompt_tokens or out.prompt_len
        out.cached_tokens = final.usage.cached_tokens
        if final.usage.HasField("timing"):
            out.server_queue_s = final.usage.timing.prefill_queue_ms / 1e3
            out.server_prefill_s = final.usage.timing.prefill_compute_ms / 1e3
        out.success = out.output_tokens > 0
        if not out.success:
            out.error = "no output tokens"
        return out

    async def close(self) -> None:
        await self.channel.close()


def grpc_request(req: BenchRequest, opts: SamplingOptions):
    """The Router.Generate request for ``req`` (a JSON schema: StructuredOutputs.json_schema)."""
    from proto.client import build_request

    prompt = {"token_ids": req.prompt} if isinstance(req.prompt, list) else {}
    request = build_request(
        None if prompt else req.prompt,
        **prompt,
        max_tokens=req.output_len,
        temperature=opts.temperature,
        ignore_eos=opts.ignore_eos,
        model=req.model,
    )
    if req.json_schema is not None:
        request.sampling.structured_outputs.json_schema = json.dumps(req.json_schema)
    return request
