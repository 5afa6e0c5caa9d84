"""Batched sampling with per-request parameters (vLLM's semantics and order).

Order for each row: a structured-output row's grammar bitmask (before
everything, so its logprobs are those of tokens the grammar allows, as vLLM's
are); allowed_token_ids, bad_words, logit_bias and min_tokens masks; then
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
from engine.spec_decode.rejection import DraftProbs, rejection_sample


@dataclass(slots=True, eq=False)
class SamplingRow:
    """One sequence's sampling inputs.

    ``token_ids`` is the sequence's own list (prompt then output), not a copy:
    only penalties read it, so a row is built once per sequence and serves
    every step. Rows compare by identity, which is how the sampler sees that
    a batch is the same as the last one.
    """

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    # EOS and stop ids to mask while fewer than min_tokens have been generated.
    min_tokens_stop_ids: list[int]
    # The masks' ids on the device, sent once (allowed ids, logit-bias ids and
    # values, min_tokens stop ids).
    device_masks: tuple[torch.Tensor | None, ...] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_output_ids(self) -> int:
        """Output ids the sequence has, a migrated request's earlier ones too
        (the last resume_offset ids of its prompt)."""
        return self.num_output_tokens + self.params.resume_offset


@dataclass(slots=True)
class BatchPlan:
    """What a batch of rows asks of the sampler: host facts and the small device
    tensors built from them. Kept while the next batch has the very same rows
    (steady decoding), so a step usually builds none of it."""

    rows: list[SamplingRow]
    want_logprobs: list[int | None]
    logprob_rows: list[int]
    logprob_index: torch.Tensor | None
    mask_rows: list[int]  # allowed ids, bad words, logit bias or min_tokens
    penalty_rows: list[int]
    all_greedy: bool
    any_greedy: bool
    seeded_rows: list[int]  # own generators (and not greedy)
    temperatures: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    greedy_mask: torch.Tensor | None = None


@dataclass(slots=True)
class GrammarBitmask:
    """The allowed tokens of a step's structured-output rows: bit ``t % 32`` of
    ``bits[k, t // 32]`` says whether token ``t`` may follow in sample row
    ``rows[k]`` (xgrammar's layout). ``bits`` is filled on the host (pinned on
    CUDA) and copied to the device by the sampler."""

    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32
    rows: list[int]


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


def bad_word_bans(words: list[list[int]], token_ids: list[int], num_output: int) -> list[int]:
    """vLLM's bad-words rule: the last token of each word whose other tokens
    end the output so far (a one-token word: always). Only output counts,
    never the prompt."""
    banned = []
    for word in words:
        k = len(word) - 1
        if k > num_output:
            continue
        if k == 0 or token_ids[len(token_ids) - k :] == word[:-1]:
            banned.append(word[-1])
    return banned


def apply_token_bitmask(logits: torch.Tensor, bitmask: GrammarBitmask) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask disallows.

    Pure torch, so it runs wherever the logits are (no kernel to compile): the
    int32 words are read as little-endian bytes, each byte's 8 bits spread
    over 8 tokens (token ``8 * b + i`` is bit ``i`` of byte ``b``)."""
    dev = logits.device
    bits = bitmask.bits
    if dev.type == "cuda":
        bits = bits.to(dev, non_blocking=True)
    vocab = logits.shape[1]
    as_bytes = bits.contiguous().view(torch.uint8)  # [k, 4 * words]
    # Made on the device: a host list copied there would wait for the stream.
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    allowed = ((as_bytes.unsqueeze(-1) >> shifts) & 1).bool()  # [k, 4 * words, 8]
    allowed = allowed.view(len(bitmask.rows), -1)[:, :vocab]
    if len(bitmask.rows) == logits.shape[0] and bitmask.rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = _host_tensor(bitmask.rows, torch.int64, dev)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


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
        self._plan: BatchPlan | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: GrammarBitmask | None = None,
    ) -> SamplerOutput:
        return self.sample(logits, rows, bitmask).to_host()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: GrammarBitmask | None = None,
        drafts: DraftProbs | None = None,
    ) -> DeviceSamples:
        """Sample on the device without waiting for it: the results stay tensors
        (async scheduling feeds ``token_ids`` to the next step before the host
        has seen them). ``bitmask``: the structured-output rows' allowed tokens;
        ``drafts``: a draft model's sampled proposals, decided by rejection
        sampling against the rows' final distributions (engine/spec_decode/
        rejection.py) before logprobs are gathered for the tokens chosen."""
        plan = self._plan_for(rows, logits)
        logits = logits.float()
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if plan.logprob_rows else None
        if plan.mask_rows:
            self._apply_masks_and_bias(logits, rows, plan.mask_rows)
        if plan.penalty_rows:
            self._apply_penalties(logits, rows, plan.penalty_rows)
        token_ids, probs = self._sample(logits, rows, plan)
        if drafts is not None:
            token_ids = rejection_sample(probs, token_ids, drafts, self.generator)
        out = DeviceSamples(token_ids, plan.want_logprobs)
        if raw_logprobs is not None:
            out.logprob_rows = plan.logprob_rows
            idx = plan.logprob_index
            k_max = max(plan.want_logprobs[i] for i in plan.logprob_rows)
            out.logprob_tensors = top_logprobs(raw_logprobs[idx], token_ids[idx], k_max)
        return out

    def _plan_for(self, rows: list[SamplingRow], logits: torch.Tensor) -> BatchPlan:
        plan = self._plan
        if plan is not None and plan.rows == rows:  # element identity: same rows
            return plan
        dev = logits.device
        want_logprobs: list[int | None] = []
        logprob_rows, mask_rows, penalty_rows, seeded_rows = [], [], [], []
        greedy_rows: list[bool] = []
        for i, r in enumerate(rows):
            p = r.params
            want_logprobs.append(p.logprobs)
            if p.logprobs is not None:
                logprob_rows.append(i)
            masked = p.allowed_token_ids is not None or p.bad_words_token_ids
            if masked or p.logit_bias or r.min_tokens_stop_ids:
                mask_rows.append(i)
            if p.needs_penalties:
                penalty_rows.append(i)
            greedy = p.greedy
            greedy_rows.append(greedy)
            if r.generator is not None and not greedy:
                seeded_rows.append(i)
        all_greedy = all(greedy_rows)
        plan = BatchPlan(
            rows=list(rows),
            want_logprobs=want_logprobs,
            logprob_rows=logprob_rows,
            logprob_index=_host_tensor(logprob_rows, torch.int64, dev) if logprob_rows else None,
            mask_rows=mask_rows,
            penalty_rows=penalty_rows,
            all_greedy=all_greedy,
            any_greedy=any(greedy_rows),
            seeded_rows=seeded_rows,
        )
        if not all_greedy:
            params = [r.params for r in rows]
            plan.temperatures = _host_tensor(
                [1.0 if p.greedy else p.temperature for p in params], torch.float32, dev
            )
            if any(p.min_p > 0.0 for p in params):
                plan.min_p = _host_tensor([p.min_p for p in params], torch.float32, dev)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                vocab = logits.shape[-1]
                plan.top_k = _host_tensor(
                    [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params],
                    torch.int64,
                    dev,
                )
                plan.top_p = _host_tensor([p.top_p for p in params], torch.float32, dev)
            if plan.any_greedy:
                plan.greedy_mask = _host_tensor(greedy_rows, torch.bool, dev)
        self._plan = plan
        return plan

    # ------------------------------------------------------------- processing
    def _apply_masks_and_bias(
        self, logits: torch.Tensor, rows: list[SamplingRow], which: list[int]
    ) -> None:
        for i in which:
            row = rows[i]
            p = row.params
            if row.device_masks is None:
                dev = logits.device
                allowed = p.allowed_token_ids
                bias = p.logit_bias
                stop = row.min_tokens_stop_ids
                row.device_masks = (
                    _host_tensor(allowed, torch.int64, dev) if allowed is not None else None,
                    _host_tensor(list(bias), torch.int64, dev) if bias else None,
                    _host_tensor(list(bias.values()), torch.float32, dev) if bias else None,
                    _host_tensor(stop, torch.int64, dev) if stop else None,
                )
            allowed, bias_ids, bias_values, stop_ids = row.device_masks
            if allowed is not None:
                kept = logits[i, allowed].clone()
                logits[i].fill_(float("-inf"))
                logits[i, allowed] = kept
            if p.bad_words_token_ids:
                banned = bad_word_bans(p.bad_words_token_ids, row.token_ids, row.num_output_ids)
                if banned:
                    logits[i, _host_tensor(banned, torch.int64, logits.device)] = float("-inf")
            if bias_ids is not None:
                logits[i].index_add_(0, bias_ids, bias_values)
            if stop_ids is not None and row.num_output_tokens < p.min_tokens:
                logits[i, stop_ids] = float("-inf")

    def _apply_penalties(
        self, logits: torch.Tensor, rows: list[SamplingRow], which: list[int]
    ) -> None:
        for i in which:
            row = rows[i]
            p = row.params
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

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], plan: BatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens, and the distributions the non-greedy rows drew from
        (None when every row is greedy)."""
        # Row facts are host data: deciding on them never waits for the GPU.
        argmax = logits.argmax(dim=-1)
        if plan.all_greedy:
            return argmax, None
        logits = logits / plan.temperatures.unsqueeze(1)
        if plan.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * plan.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if plan.top_k is not None:
            logits = _top_k_top_p(logits, plan.top_k, plan.top_p)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for i in plan.seeded_rows:
            q[i].exponential_(generator=rows[i].generator)
        # exponential_ can return exactly 0, which would make probs / q inf (or NaN
        # for a masked token): keep q strictly positive.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        sampled = (probs / q).argmax(dim=-1)
        if not plan.any_greedy:
            return sampled, probs
        return torch.where(plan.greedy_mask, argmax, sampled), probs


def _top_k_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    # top_k: drop everything below the k-th largest value.
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # top_p: drop the smallest tokens whose total mass stays within 1 - top_p,
    # always keeping the largest.
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - p.to(logits.dtype)).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
