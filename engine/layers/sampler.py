"""Batched sampling with per-request parameters (vLLM's semantics and order).

Order for each row: allowed_token_ids, logit_bias and min_tokens masks; then
repetition (prompt + output), frequency and presence (output) penalties; then
greedy argmax, or temperature -> min_p -> top_k -> top_p -> sample.

Sampling draws ``argmax(p / q)`` with ``q ~ Exponential(1)``, which picks token
``i`` with probability ``p_i``. A request with a ``seed`` draws its ``q`` from
its own generator, so its samples depend only on its seed and its own history,
never on what else is in the batch.

Logprobs are those of the raw model distribution, before any processing
(vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs


@dataclass(slots=True)
class SamplingRow:
    """One sequence's sampling inputs for this step.

    ``token_ids`` is the sequence's own list (prompt then output), not a copy:
    only penalties read it, so building a row costs nothing per token.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    # EOS and stop ids to mask while fewer than min_tokens have been generated.
    min_tokens_stop_ids: list[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(slots=True)
class DeviceSamples:
    """One step's samples, still on the device (``to_host`` waits for them)."""

    token_ids: torch.Tensor  # [rows] int64
    want_logprobs: list[int | None]
    logprob_rows: list[int] = field(default_factory=list)
    # (chosen logprob, rank, top ids, top logprobs) of the logprob_rows.
    logprob_tensors: tuple[torch.Tensor, ...] | None = None

    def copy_to_host(self, non_blocking: bool) -> None:
        """Start the device-to-host copies (pinned buffers, so they can overlap)."""
        pin = non_blocking and self.token_ids.device.type == "cuda"
        self.token_ids = _to_host(self.token_ids, pin)
        if self.logprob_tensors is not None:
            self.logprob_tensors = tuple(_to_host(t, pin) for t in self.logprob_tensors)

    def to_host(self) -> SamplerOutput:
        """Plain lists (waits for the device if ``copy_to_host`` was not synchronised)."""
        logprob_out: list[TokenLogprobs | None] = [None] * len(self.want_logprobs)
        if self.logprob_tensors is not None:
            lp, rank, top_ids, top_lp = (t.tolist() for t in self.logprob_tensors)
            for j, i in enumerate(self.logprob_rows):
                k = self.want_logprobs[i]
                logprob_out[i] = TokenLogprobs(lp[j], rank[j], top_ids[j][:k], top_lp[j][:k])
        return SamplerOutput(self.token_ids.tolist(), logprob_out)


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if not pin:
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def top_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen logprob, chosen rank, top-k ids, top-k logprobs) for each row."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    rank = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
    top_lp, top_ids = (
        logprobs.topk(k, dim=1) if k > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    )
    return chosen_lp, rank, top_ids, top_lp


def _host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a synchronous copy."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Unseeded requests share this generator: reproducible for a given
        # engine seed and workload, as vLLM's global seed is.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).to_host()

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> DeviceSamples:
        """Sample on the device without waiting for it: the results stay tensors
        (async scheduling feeds ``token_ids`` to the next step before the host
        has seen them)."""
        logits = logits.float()
        want_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        )
        self._apply_masks_and_bias(logits, rows)
        self._apply_penalties(logits, rows)
        token_ids = self._sample(logits, rows)
        out = DeviceSamples(token_ids, want_logprobs)
        if raw_logprobs is not None:
            out.logprob_rows = [i for i, k in enumerate(want_logprobs) if k is not None]
            idx = _host_tensor(out.logprob_rows, torch.int64, logits.device)
            k_max = max(want_logprobs[i] for i in out.logprob_rows)
            out.logprob_tensors = top_logprobs(raw_logprobs[idx], token_ids[idx], k_max)
        return out

    # ------------------------------------------------------------- processing
    def _apply_masks_and_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            p = row.params
            if p.allowed_token_ids is not None:
                allowed = torch.tensor(p.allowed_token_ids, device=logits.device)
                kept = logits[i, allowed].clone()
                logits[i].fill_(float("-inf"))
                logits[i, allowed] = kept
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
                logits[i].index_add_(0, ids, bias)
            if row.min_tokens_stop_ids and row.num_output_tokens < p.min_tokens:
                logits[i, row.min_tokens_stop_ids] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        for i, row in enumerate(rows):
            p = row.params
            if not p.needs_penalties:
                continue
            ids = torch.tensor(row.token_ids, dtype=torch.long, device=logits.device)
            # Frequency and presence count output tokens only (as vLLM's). A
            # migrated request's last resume_offset prompt tokens are output it
            # generated on another node: they count as output, as they did there.
            first_output = row.num_prompt_tokens - p.resume_offset
            counts = torch.bincount(ids[first_output:], minlength=self.vocab_size)
            counts = counts[: self.vocab_size]
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[ids[: row.num_prompt_tokens]] = True
                penalised = torch.where(
                    logits[i] > 0,
                    logits[i] / p.repetition_penalty,
                    logits[i] * p.repetition_penalty,
                )
                logits[i] = torch.where(seen, penalised, logits[i])
            if p.frequency_penalty != 0.0:
                logits[i] -= p.frequency_penalty * counts.to(logits.dtype)
            if p.presence_penalty != 0.0:
                logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # Row facts are host data: deciding on them never waits for the GPU.
        greedy_rows = [r.params.greedy for r in rows]
        argmax = logits.argmax(dim=-1)
        if all(greedy_rows):
            return argmax
        dev = logits.device
        temps = _host_tensor(
            [1.0 if r.params.greedy else r.params.temperature for r in rows], torch.float32, dev
        )
        logits = logits / temps.unsqueeze(1)
        if any(r.params.min_p > 0.0 for r in rows):
            min_p = _host_tensor([r.params.min_p for r in rows], torch.float32, dev)
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
            logits = self._top_k_top_p(logits, rows)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None and not row.params.greedy:
                q[i].exponential_(generator=row.generator)
        # exponential_ can return exactly 0, which would make probs / q inf (or NaN
        # for a masked token): keep q strictly positive.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        sampled = (probs / q).argmax(dim=-1)
        if not any(greedy_rows):
            return sampled
        return torch.where(_host_tensor(greedy_rows, torch.bool, dev), argmax, sampled)

    def _top_k_top_p(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        k = _host_tensor(
            [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in rows],
            torch.int64,
            logits.device,
        )
        p = _host_tensor([r.params.top_p for r in rows], logits.dtype, logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        # top_k: drop everything below the k-th largest value.
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        # top_p: drop the smallest tokens whose total mass stays within 1 - top_p,
        # always keeping the largest.
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
