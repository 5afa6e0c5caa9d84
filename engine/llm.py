"""The offline API: ``LLM(model=..., **config).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.input_processor import PromptType
from engine.llm_engine import LLMEngine
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PROFILER_DIR_ENV = "PDSERVE_TORCH_PROFILER_DIR"
ChatMessage = dict[str, Any]


class LLM:
    """An engine plus a loop that runs batches of prompts to completion."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self._request_ids = itertools.count()
        self._profiler: torch.profiler.profile | None = None

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    # ------------------------------------------------------------- generate
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in the prompts' order.

        A prompt is text, a list of token ids, or a dict with "prompt" or
        "prompt_token_ids" (and optionally "cache_salt"). A single list of ints is
        one prompt; a list of lists is many. ``lora_request``: one adapter for
        every prompt, or one per prompt (None: the base model), as vLLM's.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        loras = _loras_per_prompt(lora_request, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm, loras)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (the engine has skip_tokenizer_init=True)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any BOS/special tokens: add none.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_per_prompt(
        self, params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            final = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            return [final] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        return [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params]

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [f"offline-{next(self._request_ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
                engine.add_request(request_id, prompt, p, lora_request=lora)
                added.append(request_id)
            return self._drain(ids, use_tqdm)
        except BaseException:
            # Bad input or Ctrl-C: free what this call added so the engine stays
            # usable, and collect the "abort" outputs nobody will read.
            engine.abort_request(added)
            if not engine.requests:
                engine.step()
            raise

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        show = use_tqdm and sys.stderr.isatty()
        start = time.perf_counter()
        num_out_tokens = 0
        with tqdm(
            total=len(ids), desc="Processed prompts", disable=not show, dynamic_ncols=True
        ) as bar:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        num_out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(
                            f"output {num_out_tokens / max(elapsed, 1e-9):.1f} tok/s"
                        )
        return [done[i] for i in ids]

    # -------------------------------------------------------------- profile
    def reset_prefix_cache(self) -> bool:
        """Evict every cached KV block no request holds (as vLLM's; always succeeds)."""
        self.llm_engine.reset_prefix_cache()
        return True

    def start_profile(self, profile_dir: str | None = None) -> None:
        """Start the torch profiler; traces go to profile_dir or $PDSERVE_TORCH_PROFILER_DIR."""
        directory = profile_dir or os.environ.get(PROFILER_DIR_ENV)
        if not directory:
            raise ValueError(f"start_profile needs profile_dir or the {PROFILER_DIR_ENV} variable")
        if self._profiler is not None:
            raise RuntimeError("the profiler is already running")
        os.makedirs(directory, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.llm_engine.model_runner.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(directory),
            record_shapes=True,
            with_stack=False,
        )
        self._profiler.start()
        logger.info("torch profiler started; traces go to %s", directory)

    def stop_profile(self) -> None:
        if self._profiler is None:
            raise RuntimeError("the profiler is not running (call start_profile first)")
        self._profiler.stop()
        self._profiler = None


def _loras_per_prompt(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, list | tuple):
        raise ValueError(
            f"lora_request must be a LoRARequest or a list of them; got "
            f"{type(lora_request).__name__}"
        )
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_requests for {n} prompts")
    return list(lora_request)


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
