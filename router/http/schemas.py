"""The OpenAI API's request bodies (pydantic), and their translation to GenerateRequest.

The HTTP edge's only job: JSON in, the same GenerateRequest the gRPC API takes out
(router/service.py validates it, once, for both). Fields pdserve cannot honour are
refused with 400 naming them, never silently dropped (docs/openai.md lists them):
every field of OpenAI's and vLLM's request bodies is honoured, refused, or
(metadata that changes no output) accepted; a field of neither is ignored, as
OpenAI and vLLM ignore fields they do not know.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from proto import pdserve_pb2
from router.frontend import CONTINUE_WITH_GENERATION_PROMPT
from router.http.chat_output import OutputPlan
from router.http.structured import (
    Constraint,
    InvalidField,
    from_guided,
    from_response_format,
    from_vllm_object,
    one_constraint,
)
from router.http.tools import plan_tools

__all__ = ["ChatCompletionRequest", "CompletionRequest", "InvalidField", "OutputPlan"]


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do (clients send their own extras).
    # NaN and infinities are not numbers a sampler can use: 400, like any bad value.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# Fields of OpenAI's or vLLM's request bodies that pdserve does not honour, and
# why: refused with 400 naming them where they ask for something (a null, false,
# empty or default value asks for nothing and passes), never silently dropped.
NOT_SUPPORTED = {
    "functions": "functions (the deprecated function calling) are not supported",
    "function_call": "function_call (the deprecated function calling) is not supported",
    "audio": "audio output is not supported by this model",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported: this model does not reason",
    "verbosity": "verbosity is not supported",
    "structural_tag": "structural_tag is not supported here: use structured_outputs",
    "use_beam_search": "beam search is not supported",
    "logits_processors": "logits_processors are not supported",
    "logprob_token_ids": "logprob_token_ids is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "prompt_embeds": "prompt_embeds are not supported",
    "documents": "documents are not supported",
    "mm_processor_kwargs": "multimodal inputs are not supported by this model",
    "kv_transfer_params": "kv_transfer_params are not supported (pdserve moves KV itself)",
    "vllm_xargs": "vllm_xargs are not supported",
    "repetition_detection": "repetition_detection is not supported",
    "thinking_token_budget": "thinking_token_budget is not supported: this model does not reason",
    "echo": "echo on chat completions (prepending the last message) is not supported",
}
# Fields honoured at one value only, the one that asks for what pdserve does anyway.
_ONLY = {
    "priority": ((0,), "priority scheduling is not supported: priority must be 0"),
    "length_penalty": ((1,), "length_penalty applies to beam search, which is not supported"),
    # truncate_prompt_tokens keeps the last tokens.
    "truncation_side": (("left",), "only truncation_side 'left' is supported"),
    "store": ((False,), "stored completions are not supported"),
}


def refuse_unsupported(extra: dict[str, Any] | None) -> None:
    """400 naming the first field of NOT_SUPPORTED, or of _ONLY at another
    value, whose value asks for something."""
    for name, value in (extra or {}).items():
        if value is None or value is False or value in ("", [], {}):
            continue
        if name in NOT_SUPPORTED:
            raise InvalidField(name, NOT_SUPPORTED[name])
        if name in _ONLY and value not in _ONLY[name][0]:
            raise InvalidField(name, _ONLY[name][1])


def check_special_tokens(extra: dict[str, Any] | None, pdserve_adds: bool) -> None:
    """vLLM's add_special_tokens: accepted where it asks for what pdserve does
    (completions' text is encoded with them, a chat template's output without)."""
    value = (extra or {}).get("add_special_tokens")
    if value is not None and value is not pdserve_adds:
        raise InvalidField(
            "add_special_tokens", f"add_special_tokens {str(value).lower()} is not supported here"
        )


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's sampling extras.
    Fields it does not declare are kept (``model_extra``) to refuse those
    pdserve cannot honour (NOT_SUPPORTED)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # tokenized by the nodes, as vLLM's engine does
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    request_id: str | None = None  # vLLM's: the request's id in the router's logs
    # vLLM's: the prompt's and each choice's token ids in the response (router/http/chunks.py).
    return_token_ids: bool | None = None
    # pdserve's tenant isolation of the prefix cache (GenerateRequest.cache_salt).
    cache_salt: str | None = None
    # pdserve's per-request opt-out of speculative decoding
    # (SamplingParams.disable_spec_decode; vLLM has no such field).
    disable_spec_decode: bool | None = None
    # OpenAI's structured outputs (vLLM's structured_outputs and guided_* are
    # read from the extras: router/http/structured.py).
    response_format: dict | None = None

    def constraint(self, *more: Constraint | None) -> Constraint | None:
        """The output's one constraint, from whichever field asked for it."""
        extra = self.model_extra or {}
        return one_constraint(
            [
                from_response_format(self.response_format),
                from_vllm_object(extra.get("structured_outputs")),
                *from_guided(extra),
                *more,
            ]
        )

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
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
            "truncate_prompt_tokens",
            "prompt_logprobs",
            "disable_spec_decode",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(s, name, value)
        if logprobs is not None:
            s.logprobs = logprobs
        if self.allowed_token_ids:
            s.allowed_token_ids.extend(self.allowed_token_ids)
        if self.bad_words:
            s.bad_words.extend(self.bad_words)
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

    def check(self) -> None:
        """What the engine never sees: fields pdserve does not honour, values
        protobuf would not even hold (int64). The engine checks the rest."""
        refuse_unsupported(self.model_extra)
        for name in (
            "max_tokens", "n", "seed", "top_k", "min_tokens", "truncate_prompt_tokens",
            "prompt_logprobs", "logprobs", "top_logprobs", "max_completion_tokens",
        ):  # fmt: skip
            # Declared fields only: an extra of the same name (chat's
            # top_logprobs on a completion) holds whatever JSON the body had.
            value = getattr(self, name) if name in type(self).model_fields else None
            if value is not None and not -(2**63) <= value < 2**63:
                raise InvalidField(name, f"{name} is out of range")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(not -(2**63) <= v < 2**63 for v in getattr(self, name) or ()):
                raise InvalidField(name, f"{name} has an id out of range")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidField(
                "prompt_logprobs", "prompt_logprobs are not available with stream: true (as vLLM)"
            )

    def generate_request(self, sampling: pdserve_pb2.SamplingParams) -> pdserve_pb2.GenerateRequest:
        return pdserve_pb2.GenerateRequest(
            sampling=sampling, cache_salt=self.cache_salt or "", request_id=self.request_id or ""
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # Token ids first and strict, tried left to right: pydantic's default
    # ("smart") union tries every member on every element, several times the
    # cost for a long prompt (docs/lab/2026-11-25-serving-afternoon.md; a bool
    # or "12" is no token id).
    prompt: Annotated[
        list[StrictInt] | str | list[str] | list[list[StrictInt]],
        Field(union_mode="left_to_right"),
    ]
    # Absent: OpenAI's default for this endpoint (and vLLM's). null: unset, up
    # to the context left, as an unset max_tokens everywhere (router/frontend.py).
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone (lm-eval's and others'
        scoring requests). The engine generates one token, which is dropped."""
        return self.echo and self.max_tokens == 0

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the echoed prompt's tokens carry their logprobs."""
        return self.echo and self.logprobs is not None

    def to_generate(self) -> list[pdserve_pb2.GenerateRequest]:
        """One GenerateRequest per prompt (OpenAI's batch of prompts)."""
        self.check()
        check_special_tokens(self.model_extra, True)
        if self.suffix:
            raise InvalidField("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidField("best_of", "best_of other than n is not supported")
        if self.echo_logprobs and self.truncate_prompt_tokens is not None:
            raise InvalidField(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens with echo and logprobs is not supported",
            )
        sampling = self.sampling(1 if self.echo_only else self.max_tokens, self.logprobs)
        if (constraint := self.constraint()) is not None:
            sampling.structured_outputs.CopyFrom(constraint.spec)
        if self.echo_logprobs and self.prompt_logprobs is None:
            # The echoed prompt's logprobs are its prompt logprobs, as many
            # candidates as the generated tokens get (vLLM).
            sampling.prompt_logprobs = self.logprobs
        out = []
        for p in self.prompts():
            request = self.generate_request(sampling)
            if isinstance(p, str):
                request.prompt = p
            else:
                try:  # protobuf refuses what int64 cannot hold (no Python loop here)
                    request.token_ids.ids.extend(p)
                except ValueError:
                    raise InvalidField("prompt", "prompt has a token id out of range") from None
            out.append(request)
        return out

    def prompts(self) -> list:
        prompt = self.prompt
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidField("prompt", "prompt is empty: it must have at least one token")
            return [prompt]
        if not prompt:
            raise InvalidField("prompt", "prompt is empty: it must have at least one token")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ContentPart(_Body):
    """A part of a message's content; only text parts are honoured (to_generate)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: str
    text: str | None = None


# Content parts of other types, and what a text-only model says of them.
_MEDIA = {
    "image_url": "images are not supported by this model (it reads text only)",
    "input_image": "images are not supported by this model (it reads text only)",
    "image": "images are not supported by this model (it reads text only)",
    "input_audio": "audio is not supported by this model (it reads text only)",
    "audio_url": "audio is not supported by this model (it reads text only)",
    "video_url": "video is not supported by this model (it reads text only)",
    "file": "files are not supported by this model (it reads text only)",
}


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_proto(self, i: int, out: pdserve_pb2.ChatMessage) -> None:
        # The chat templates of small models know "system", not OpenAI's newer name for it.
        out.role = "system" if self.role == "developer" else self.role
        out.content = self.text(i)
        out.tool_call_id = self.tool_call_id or ""
        out.name = self.name or ""
        for j, call in enumerate(self.tool_calls or ()):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidField(
                    f"messages.{i}.tool_calls.{j}.function", "a tool call needs a function name"
                )
            args = function.get("arguments", "{}")
            out.tool_calls.add(
                id=str(call.get("id") or ""),
                name=function["name"],
                arguments=args if isinstance(args, str) else json.dumps(args),
            )

    def text(self, i: int) -> str:
        """The message's text; 400 naming the part that is not text."""
        for name in ("function_call", "audio"):
            if (self.model_extra or {}).get(name):
                raise InvalidField(
                    f"messages.{i}.{name}", f"messages with {name} are not supported"
                )
        if not isinstance(self.content, list):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            where = f"messages.{i}.content.{j}"
            if part.type != "text":
                reason = _MEDIA.get(
                    part.type, f"content parts of type {part.type!r} are not supported"
                )
                raise InvalidField(where, reason)
            if part.text is None:
                raise InvalidField(f"{where}.text", "a text part needs its text")
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    modalities: list[str] | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict | None = None
    # vLLM's: continue the last message (a prefilled answer) instead of opening a new one.
    continue_final_message: bool = False
    # vLLM's: the request's own Jinja template; the router refuses it without
    # --trust-request-chat-template (router/frontend.py).
    chat_template: str | None = None

    def to_generate(
        self, tool_parser: str | None = None, reasoning: bool = False
    ) -> tuple[pdserve_pb2.GenerateRequest, OutputPlan]:
        """The request, and what its output text goes through (tool calls, reasoning)."""
        self.check()
        check_special_tokens(self.model_extra, False)
        plan = plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, tool_parser)
        constraint = self.constraint(plan.constraint() if plan else None)
        if any(m != "text" for m in self.modalities or ()):
            raise InvalidField(
                "modalities",
                "this model writes text only: modalities other than text (audio) are not supported",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidField("continue_final_message", CONTINUE_WITH_GENERATION_PROMPT)
        # Unset: up to the context left, as OpenAI and vLLM do (resolved by the
        # router, router/frontend.py).
        given = [v for v in (self.max_completion_tokens, self.max_tokens) if v is not None]
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        request = self.generate_request(self.sampling(given[0] if given else None, logprobs))
        if constraint is not None:
            request.sampling.structured_outputs.CopyFrom(constraint.spec)
        chat = request.chat
        chat.add_generation_prompt = self.add_generation_prompt
        for i, m in enumerate(self.messages):
            m.to_proto(i, chat.messages.add())
        if plan is not None:
            chat.tools.extend(plan.messages)
        if self.chat_template_kwargs:
            chat.chat_template_kwargs = json.dumps(self.chat_template_kwargs)
        chat.continue_final_message = self.continue_final_message
        chat.chat_template = self.chat_template or ""
        return request, OutputPlan(
            reasoning, plan, tool_parser, constraint.param if constraint else None
        )
