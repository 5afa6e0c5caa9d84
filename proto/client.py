"""A light client for pdserve's Router: it imports only grpcio and protobuf.

    from proto.client import generate, generate_text

    for response in generate("localhost:50051", "Hello", max_tokens=32):
        for delta in response.deltas:
            print(delta.text, end="", flush=True)

    text, final = generate_text("localhost:50051", chat=[{"role": "user", "content": "Hi"}])

``agenerate`` is the asyncio twin of ``generate``. Sampling parameters are
keyword arguments with vLLM's names; errors arrive as ``grpc.RpcError``.

A router with API tokens and TLS (docs/security.md)::

    creds = channel_credentials(ca="ca.pem")  # + cert=, key= where it requires mTLS
    text, final = generate_text("router:50051", "Hello", token="...", credentials=creds)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from proto import pdserve_pb2, pdserve_pb2_grpc

_REPEATED = {"stop", "stop_token_ids", "allowed_token_ids", "bad_words"}


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    chat: Sequence[Mapping[str, str]] | None = None,
    request_id: str = "",
    cache_salt: str = "",
    model: str = "",
    **sampling: Any,
) -> pdserve_pb2.GenerateRequest:
    """A GenerateRequest from exactly one of ``prompt``, ``token_ids`` or ``chat``;
    ``model``: a LoRA adapter's name (empty: the served model)."""
    given = [x is not None for x in (prompt, token_ids, chat)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, token_ids or chat")
    req = pdserve_pb2.GenerateRequest(request_id=request_id, cache_salt=cache_salt, model=model)
    if prompt is not None:
        req.prompt = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.chat.messages.extend(
            pdserve_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in chat
        )
    sp = req.sampling
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "logit_bias":
            for token, bias in value.items():
                sp.logit_bias[int(token)] = float(bias)
        elif name in _REPEATED:
            getattr(sp, name).extend([value] if isinstance(value, str) else value)
        elif name == "structured_outputs":  # a StructuredOutputs message
            sp.structured_outputs.CopyFrom(value)
        elif name in pdserve_pb2.SamplingParams.DESCRIPTOR.fields_by_name:
            setattr(sp, name, value)
        else:
            raise ValueError(f"unknown sampling parameter {name!r}")
    return req


def channel_credentials(
    ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> grpc.ChannelCredentials:
    """TLS from PEM files: ``ca`` verifies the router (None: the system's CAs);
    ``cert`` and ``key``: a client certificate, for a router that requires one (mTLS)."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both cert and key")

    def read(path):
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert)
    )


def _with_token(
    metadata: Sequence[tuple[str, str]] | None, token: str | None
) -> Sequence[tuple[str, str]] | None:
    if not token:
        return metadata
    return (*(metadata or ()), ("authorization", f"Bearer {token}"))


def generate(
    address: str,
    prompt: str | None = None,
    *,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    token: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    channel: grpc.Channel | None = None,
    **kwargs: Any,
) -> Iterator[pdserve_pb2.GenerateResponse]:
    """Stream one generation: one message per step with new output; the last has a Final.

    ``token``: the router's API token; ``credentials``: TLS (``channel_credentials``)."""
    request = build_request(prompt, **kwargs)
    own = channel is None
    if channel is None:
        channel = (
            grpc.secure_channel(address, credentials)
            if credentials is not None
            else grpc.insecure_channel(address)
        )
    try:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        yield from stub.Generate(request, timeout=timeout, metadata=_with_token(metadata, token))
    finally:
        if own:
            channel.close()


def generate_text(
    address: str, prompt: str | None = None, **kwargs: Any
) -> tuple[str, pdserve_pb2.Final]:
    """The whole text of completion 0 and the Final message."""
    parts: list[str] = []
    final = None
    for response in generate(address, prompt, **kwargs):
        parts.extend(d.text for d in response.deltas if d.index == 0)
        if response.HasField("final"):
            final = response.final
    if final is None:  # pragma: no cover - the server always ends with a Final
        raise RuntimeError("the stream ended without a Final message")
    return "".join(parts), final


async def agenerate(
    address: str,
    prompt: str | None = None,
    *,
    timeout: float | None = None,
    metadata: Sequence[tuple[str, str]] | None = None,
    token: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    channel: grpc.aio.Channel | None = None,
    **kwargs: Any,
) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """The asyncio twin of ``generate``."""
    request = build_request(prompt, **kwargs)
    own = channel is None
    if channel is None:
        channel = (
            grpc.aio.secure_channel(address, credentials)
            if credentials is not None
            else grpc.aio.insecure_channel(address)
        )
    try:
        stub = pdserve_pb2_grpc.RouterStub(channel)
        metadata = _with_token(metadata, token)
        async for response in stub.Generate(request, timeout=timeout, metadata=metadata):
            yield response
    finally:
        if own:
            await channel.close()
