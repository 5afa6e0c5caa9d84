"""The OpenAI API's request bodies (pydantic), and their translation to GenerateRequest.

The HTTP edge's only job: JSON in, the same GenerateRequest the gRPC API takes out
(router/service.py validates it, once, for both). Fields pdserve cannot honour are
refused with 400 naming them, never silently dropped (docs/openai.md lists them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from proto import pdserve_pb2


class InvalidField(ValueError):
    """A field the request cannot have (400, ``param`` naming it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do (clients send their own extras).
    # NaN and infinities are not numbers a sampler can use: 400, like any bad value.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's sampling extras."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # pdserve's tenant isolation of the prefix cache (GenerateRequest.cache_salt).
    cache_salt: str | None = None

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> pdserve_pb2.SamplingParams:
        s = pdserve_pb2.SamplingParams(n=self.n)
        if max_tokens is not None:
            s.max_tokens = max_tokens
        for name in (
            "temperature",
            "top_p",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(s, name, value)
        if logprobs is not None:
            s.logprobs = logprobs
        if self.stop is not None:
            s.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.stop_token_ids:
            s.stop_token_ids.extend(self.stop_token_ids)
        for key, bias in (self.logit_bias or {}).items():
            try:
                s.logit_bias[int(key)] = bias
            except ValueError:
                raise InvalidField(
                    "logit_bias", f"logit_bias key {key!r} is not a token id"
                ) from None
        return s

    def check_range(self) -> None:
        """Out-of-range values protobuf would not even hold (int64); the engine checks the rest."""
        for name in ("max_tokens", "n", "seed", "top_k", "min_tokens"):
            value = getattr(self, name)
            if value is not None and not -(2**63) <= value < 2**63:
                raise InvalidField(name, f"{name} is out of range")
        for value in self.stop_token_ids or ():
            if not -(2**63) <= value < 2**63:
                raise InvalidField("stop_token_ids", "stop_token_ids has an id out of range")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # Token ids first and strict, tried left to right: pydantic's default
    # ("smart") union tries every member on every element, 0.9 ms for the body
    # of a 2,176-token prompt against 0.14 ms this way (2-core VM; a bool or
    # "12" is no token id).
    prompt: Annotated[
        list[StrictInt] | str | list[str] | list[list[StrictInt]],
        Field(union_mode="left_to_right"),
    ]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_generate(self) -> list[pdserve_pb2.GenerateRequest]:
        """One GenerateRequest per prompt (OpenAI's batch of prompts)."""
        self.check_range()
        if self.suffix:
            raise InvalidField("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidField("best_of", "best_of other than n is not supported")
        if self.echo and self.logprobs is not None:
            raise InvalidField("echo", "echo with logprobs (prompt logprobs) is not supported")
        sampling = self.sampling(self.max_tokens, self.logprobs)
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif not prompt:
            raise InvalidField("prompt", "prompt is empty")
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        out = []
        for p in prompts:
            request = pdserve_pb2.GenerateRequest(
                sampling=sampling, cache_salt=self.cache_salt or ""
            )
            if isinstance(p, str):
                request.prompt = p
            else:
                try:  # protobuf refuses what int64 cannot hold (no Python loop here)
                    request.token_ids.ids.extend(p)
                except ValueError:
                    raise InvalidField("prompt", "prompt has a token id out of range") from None
            out.append(request)
        return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None
    response_format: dict | None = None

    def to_generate(self, max_model_len: int) -> pdserve_pb2.GenerateRequest:
        self.check_range()
        if self.tools:
            raise InvalidField("tools", "tools (function calling) are not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise InvalidField("response_format", "only response_format type 'text' is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
        # Unset: up to the context length, as OpenAI and vLLM do (the engine
        # ends the sequence at max_model_len with finish_reason "length").
        given = [v for v in (self.max_completion_tokens, self.max_tokens) if v is not None]
        max_tokens = given[0] if given else max_model_len
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        request = pdserve_pb2.GenerateRequest(
            sampling=self.sampling(max_tokens, logprobs), cache_salt=self.cache_salt or ""
        )
        request.chat.add_generation_prompt = self.add_generation_prompt
        for m in self.messages:
            content = m.content if isinstance(m.content, str) else ""
            if isinstance(m.content, list):
                content = "".join(part.text for part in m.content)
            # The chat templates of small models know "system", not OpenAI's newer name for it.
            role = "system" if m.role == "developer" else m.role
            request.chat.messages.add(role=role, content=content)
        return request
