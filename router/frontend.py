"""Turning a GenerateRequest into checked token ids: the router's only model knowledge.

Reuses the engine's own InputProcessor (and SamplingParams) so the router
rejects exactly what a node would, before any node is involved, against the
context length the nodes registered (router/limits.py).

An unset ``max_tokens`` is resolved by the engine's rule (the context left
after the prompt) and sent downstream resolved (``ParsedRequest.sampling``):
a node, and a migrated request's continuation, see the number the router
checked. An explicit ``max_tokens`` that cannot fit beside the prompt is
refused (vLLM's rule), never cut short.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from common.wire import sampling_params_from_proto, token_ids_of
from engine.block_hash import HasherCache
from engine.config import EngineConfig
from engine.input_processor import InputProcessor
from engine.sampling_params import SamplingParams
from engine.structured import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS
from engine.structured.json_schema import check_schema
from engine.tokenizer import load_tokenizer
from proto import pdserve_pb2
from router.limits import ServedLength
from router.models import BASE_MODEL, ModelChoice
from router.numerics import PromptHashes, ServedNumerics


@dataclass(slots=True)
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str
    block_hashes: PromptHashes  # in each numerics class of the nodes (router/numerics.py)
    # What goes downstream: the request's sampling with max_tokens resolved.
    sampling: pdserve_pb2.SamplingParams
    max_model_len: int  # the context length the request was checked against
    model: ModelChoice = BASE_MODEL  # its LoRA adapter, which keys its block hashes


@dataclass(slots=True)
class Early:
    """A prompt's token ids and block hashes, known before its checks (Frontend.early)."""

    token_ids: list[int]
    block_hashes: PromptHashes


class Frontend:
    def __init__(self, config: EngineConfig, trust_request_chat_template: bool = False) -> None:
        """``trust_request_chat_template``: the router's --trust-request-chat-template
        (a request's own chat template is refused without it, as vLLM's is)."""
        self.config = config
        self.trust_request_chat_template = trust_request_chat_template
        # Without a tokenizer (skip_tokenizer_init) only token-id prompts are accepted.
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer)
        eos = set(config.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.inputs = InputProcessor(config, self.tokenizer, frozenset(eos))
        self.model_id = config.served_model_name
        # The nodes' context length, learnt by every routing read (router/limits.py).
        self.served = ServedLength(config.max_model_len, self.model_id)
        self.block_size = config.kvcache_block_size
        self._hashers = HasherCache(self.model_id, self.block_size)
        # The nodes' numerics classes, learnt by every routing read like their
        # context length: a prompt is hashed once per class (router/numerics.py).
        self.numerics = ServedNumerics(self.model_id)

    def early(
        self, request: pdserve_pb2.GenerateRequest, model: ModelChoice = BASE_MODEL
    ) -> Early | None:
        """The prompt's token ids and block hashes before any check, where parse
        will find the same ids: token ids, or text a tokenizer encodes, without
        truncation. The router starts its routing read with them and checks the
        request during the round trip. Never raises: a problem is parse's to
        report, in parse's order (so a chat prompt, whose template can fail, waits)."""
        if request.sampling.HasField("truncate_prompt_tokens"):
            return None
        which = request.WhichOneof("input")
        try:
            if which == "token_ids":
                ids = token_ids_of(request.token_ids.ids)
            elif which == "prompt" and self.tokenizer is not None:
                ids = self.tokenizer.encode(request.prompt)  # InputProcessor's own call
            else:
                return None
            return Early(ids, self.block_hashes(ids, request.cache_salt, model))
        except Exception:
            return None

    def block_hashes(self, ids: list[int], cache_salt: str, model: ModelChoice) -> PromptHashes:
        """The prompt's full-block hashes in each numerics class of the nodes:
        the digests each node's engine computes for it (its numerics keys with
        the request's adapter's, engine/llm_engine.py)."""
        lora = model.extra_keys
        return PromptHashes(
            {
                keys: self._hashers.get(cache_salt, keys + lora).hash_blocks(ids)
                for keys in self.numerics.classes
            }
        )

    @property
    def max_model_len(self) -> int:
        return self.served.max_model_len

    def parse(
        self,
        request: pdserve_pb2.GenerateRequest,
        early: Early | None = None,
        model: ModelChoice = BASE_MODEL,
    ) -> ParsedRequest:
        """Raises ValueError naming the problem (-> INVALID_ARGUMENT). ``early``:
        what ``early(request, model)`` gave, not computed again; ``model``: the
        model ``request.model`` names (router/models.py)."""
        max_len = self.inputs.max_model_len = self.served.max_model_len
        params = sampling_params_from_proto(request.sampling)
        prompt = self._prompt(request, early)
        processed = self.inputs.process(prompt, params)
        if params.max_tokens is not None:  # explicit: it must fit
            self._check_fits(len(processed.token_ids), params.max_tokens, max_len)
        params.max_tokens = processed.max_tokens
        if early is not None and processed.token_ids == early.token_ids:
            hashes = early.block_hashes
        else:
            hashes = self.block_hashes(processed.token_ids, request.cache_salt, model)
        return ParsedRequest(
            processed.token_ids,
            params,
            request.cache_salt,
            hashes,
            _resolved(request.sampling, processed.max_tokens),
            max_len,
            model,
        )

    def _prompt(self, request: pdserve_pb2.GenerateRequest, early: Early | None) -> dict:
        """The request's input as the InputProcessor's prompt dict."""
        which = request.WhichOneof("input")
        if which is None:
            raise ValueError("the request has no input: set prompt, token_ids or chat")
        if which == "prompt":
            prompt: dict = {"prompt": request.prompt}
            if early is not None:
                prompt["prompt_token_ids"] = early.token_ids
        elif which == "token_ids":
            ids = early.token_ids if early is not None else token_ids_of(request.token_ids.ids)
            prompt = {"prompt_token_ids": ids}
        else:
            prompt = self._chat_prompt(request.chat)
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        return prompt

    @staticmethod
    def _check_fits(num_prompt: int, max_tokens: int, max_len: int) -> None:
        """vLLM's rule: an explicit max_tokens must fit beside the prompt (unset,
        it is what the context leaves). Cutting it short instead would end the
        output with finish_reason "length" well before what the client asked."""
        if num_prompt + max_tokens > max_len:
            raise ValueError(
                f"the prompt's {num_prompt} tokens plus max_tokens {max_tokens} make "
                f"{num_prompt + max_tokens}, more than max_model_len {max_len}: shorten the "
                f"prompt or ask for at most {max_len - num_prompt} tokens"
            )

    def _chat_prompt(self, chat: pdserve_pb2.ChatMessages) -> dict:
        if not chat.messages:
            raise ValueError("chat has no messages")
        if self.tokenizer is None:
            raise ValueError("this router has no tokenizer: send token_ids")
        messages = [chat_message(m) for m in chat.messages]
        add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        if chat.continue_final_message and add_prompt:
            raise ValueError(CONTINUE_WITH_GENERATION_PROMPT)
        extra = template_kwargs(chat)
        template = request_template(chat, extra, self.trust_request_chat_template)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_prompt,
                continue_final_message=chat.continue_final_message,
                chat_template=template,
                tokenize=False,
                **extra,
            )
        except Exception as e:  # a template that rejects the roles, etc.
            raise ValueError(f"chat template failed: {e}") from e
        return {
            "prompt": text,
            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
        }

    def continuation(self, parsed: ParsedRequest, generated: list[int]) -> ParsedRequest:
        """A migrated request: the prompt followed by the tokens generated so far
        (hashed anew, so that routing finds the nodes caching any of it)."""
        prompt = [*parsed.prompt_token_ids, *generated]
        return ParsedRequest(
            prompt,
            parsed.params,
            parsed.cache_salt,
            self.block_hashes(prompt, parsed.cache_salt, parsed.model),
            parsed.sampling,
            parsed.max_model_len,
            parsed.model,
        )


def _resolved(sampling: pdserve_pb2.SamplingParams, max_tokens: int) -> pdserve_pb2.SamplingParams:
    """``sampling`` with max_tokens set: the client's own message where it was
    (no copy), else a copy with the resolved value."""
    if sampling.HasField("max_tokens"):
        return sampling
    out = pdserve_pb2.SamplingParams()
    out.CopyFrom(sampling)
    out.max_tokens = max_tokens
    return out


def chat_message(m: pdserve_pb2.ChatMessage) -> dict:
    """A message as chat templates read it (Hugging Face's convention: a tool
    call's arguments as a dict where they are a JSON object)."""
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_kwargs(chat: pdserve_pb2.ChatMessages) -> dict:
    """The template's tools and extra variables; ValueError naming a bad one."""
    extra: dict = {}
    if chat.chat_template_kwargs:
        try:
            extra = json.loads(chat.chat_template_kwargs)
        except ValueError as e:
            raise ValueError(f"chat.chat_template_kwargs is not valid JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("chat.chat_template_kwargs must be a JSON object")
        names = ("messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize")
        for name in names:
            if name in extra:
                raise ValueError(f"chat.chat_template_kwargs cannot set {name}")
    if chat.tools:
        extra["tools"] = [_tool(i, t) for i, t in enumerate(chat.tools)]
    return extra


# vLLM's words (its ChatCompletionRequest's check); unset, add_generation_prompt is true.
CONTINUE_WITH_GENERATION_PROMPT = (
    "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
)


def request_template(chat: pdserve_pb2.ChatMessages, extra: dict, trusted: bool) -> str | None:
    """The request's own chat template (chat.chat_template, or vLLM's other
    way, chat_template_kwargs' chat_template; taken out of ``extra``), or None:
    the model's. Refused unless ``trusted`` (--trust-request-chat-template):
    a template is code the router runs, and it decides every prompt's tokens."""
    given = extra.pop("chat_template", None)
    if given is not None and chat.chat_template:
        raise ValueError("chat_template is set twice: in chat_template_kwargs too")
    template = chat.chat_template or given
    if template is None:
        return None
    if not trusted:
        # The message's first word is the field to name (the HTTP edge's param).
        what = "chat_template" if chat.chat_template else "chat_template_kwargs holds a template"
        raise ValueError(
            f"{what} passed with the request, but --trust-request-chat-template is not set: "
            "refused the request with an untrusted chat template"
        )
    if not isinstance(template, str) or not template:
        raise ValueError("chat_template must be a non-empty string (a Jinja template)")
    return template


def _tool(i: int, tool: pdserve_pb2.Tool) -> dict:
    function: dict = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if not tool.name:
        raise ValueError(f"chat.tools.{i}.name is empty")
    if tool.parameters:
        where = f"chat.tools.{i}.parameters"
        try:
            function["parameters"] = json.loads(tool.parameters)
        except ValueError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        # A schema a grammar could not enforce (tool_choice required or named) is
        # refused for every tool_choice: the same tools must serve every turn.
        check_schema(function["parameters"], where, MAX_SPEC_CHARS, MAX_SCHEMA_DEPTH)
    return {"type": "function", "function": function}
