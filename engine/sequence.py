"""Sequences and requests: the engine's CPU-side state, free of torch.

One request with ``n`` completions owns ``n`` sequences. Each sequence has one
progress counter, ``num_computed_tokens`` (vLLM v1's idea): the scheduler gives
it ``len(token_ids) - num_computed_tokens`` more tokens to compute, whether
that is a whole prompt, a chunk of one, a recompute after preemption, or a
single decode token. No prefill/decode special cases.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_hash import ROOT_HASH
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.block_hash import BlockHasher
    from engine.detokenizer import IncrementalDetokenizer


# Stands for a token sampled on the device that the host has not read yet (async
# scheduling; see engine/async_step.py). Real token ids are never negative.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # Decode node: blocks reserved for the prompt, which a prefill node computes;
    # not scheduled until its KV lands and it is committed.
    RESERVED = enum.auto()
    # Blocks claimed and being filled by copies from the host tier (a prefix
    # hit there, or a swap-in); not scheduled until they have landed.
    LOADING = enum.auto()
    # Preempted by swap: its KV waits in the host tier (``swapped_slots``).
    SWAPPED = enum.auto()
    FINISHED = enum.auto()


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller


@dataclass(slots=True)
class Logprob:
    """One token's log-probability (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob facts for one sampled token (host data)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


# Per generated token: {token_id: Logprob} holding the top-k and the chosen token.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position (None for the first token, which has no context).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    hasher: BlockHasher | None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (usage report).
    num_cached_tokens: int = -1
    block_table: list[int] = field(default_factory=list)
    # Hashes of the full blocks of token_ids, extended as the sequence grows.
    block_hashes: list[bytes] = field(default_factory=list)
    # How many block_table entries are registered in the prefix cache.
    num_cached_blocks: int = 0
    # Leading block_table entries freed because every layer's sliding window
    # has passed them (they read NO_BLOCK, -1: engine/block_manager.py).
    num_window_freed_blocks: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: SampleLogprobs | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # Characters of the output text already reported (DELTA outputs).
    num_text_reported: int = 0
    num_tokens_reported: int = 0
    finish_reported: bool = False
    num_preemptions: int = 0
    # Preempted by swap: the host-tier slots holding its blocks, in table order.
    swapped_slots: list[int] = field(default_factory=list)
    # Prefill node: keep the blocks when the sequence finishes, until the node has
    # gathered them for the transfer (LLMEngine.release_held).
    hold_kv: bool = False
    # Async scheduling: the sample index, in the step in flight, of the token
    # its PLACEHOLDER stands for (-1: none; engine/async_step.py).
    pending_sample: int = -1
    # Structured outputs: its grammar is still compiling, so the scheduler
    # passes over it (engine/structured/manager.py).
    awaiting_grammar: bool = False
    # Its LoRA adapter (None: the base model); while running it holds a device
    # slot of the scheduler's LoRASlots (engine/lora/slots.py).
    lora_request: LoRARequest | None = None
    # Speculative decoding: tokens proposed to follow token_ids, checked by the
    # next step (vLLM's name; engine/spec_decode/speculator.py). Never part of
    # token_ids until the target has accepted them.
    spec_token_ids: list[int] = field(default_factory=list)
    # Draft-model speculation: positions whose draft-model KV is valid
    # (engine/spec_decode/draft_model.py).
    num_draft_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""

    def update_block_hashes(self) -> None:
        """Extend block_hashes to cover every full block of token_ids."""
        if self.hasher is None:
            return
        if len(self.token_ids) // self.hasher.block_size <= len(self.block_hashes):
            return
        parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        self.block_hashes.extend(
            self.hasher.hash_blocks(
                self.token_ids, parent=parent, start_block=len(self.block_hashes)
            )
        )


@dataclass(slots=True)
class Request:
    """A client request: one prompt, one set of params, ``params.n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence]
    cache_salt: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_reported: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    aborted: bool = False
    # Characters a stream holds back so it never emits part of a stop string.
    stop_holdback: int = 0
    # Why the engine ended it on its own (finish_reason "abort"): a grammar that
    # failed to compile, or a token its grammar rejected.
    error: str | None = None

    @property
    def finished(self) -> bool:
        if self.aborted:
            return True
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, asked every step
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.status is SequenceStatus.FINISHED for s in seqs)

    @property
    def num_cached_tokens(self) -> int:
        return max(0, self.seqs[0].num_cached_tokens)
