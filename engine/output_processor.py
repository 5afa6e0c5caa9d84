"""After each step: attach logprobs, detokenize, apply stop conditions, build outputs.

Stop conditions, in vLLM's order and with its semantics:
- nothing stops a sequence before ``min_tokens`` tokens (the sampler also masks
  EOS and stop ids until then);
- EOS (unless ``ignore_eos``) or a ``stop_token_ids`` entry: finish "stop"; the
  token stays in ``token_ids`` but adds no text unless
  ``include_stop_str_in_output``;
- a stop string completed by the new text: finish "stop", text cut before it
  (or after it with ``include_stop_str_in_output``);
- a structured output's grammar that accepted its end (a stop token, which its
  bitmask allows only once the grammar is complete): finish "stop", even with
  ``ignore_eos``;
- ``max_tokens`` generated or ``max_model_len`` reached: finish "length".
A token the grammar rejects (another constraint conflicted with it) ends the
sequence with "abort" and the request's ``error``. A finished sequence frees
its KV blocks and its grammar matcher at once.
"""

from __future__ import annotations

import time

from engine.detokenizer import TokenizerInfo, find_stop_string
from engine.model_io import PromptTokenLogprob
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind
from engine.scheduler import Scheduler
from engine.sequence import (
    FinishReason,
    Logprob,
    Request,
    Sequence,
    SequenceStatus,
    TokenLogprobs,
)
from engine.structured.scheduling import StructuredOutputs


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer_info: TokenizerInfo | None,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        structured: StructuredOutputs,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.structured = structured
        self.tok = tokenizer_info
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    # ---------------------------------------------------------------- step
    def accept_token(
        self,
        req: Request,
        seq: Sequence,
        token: int,
        logprobs: TokenLogprobs | None,
        now: float | None = None,
    ) -> None:
        """A token just appended to ``seq``: logprobs, text, stop conditions."""
        if logprobs is not None:
            self._add_logprobs(seq, token, logprobs)
        if seq.params.structured_outputs is not None and (
            error := self.structured.accept(seq, token)
        ):
            req.error = error
            self._finish(seq, FinishReason.ABORT)
        else:
            self._check_stop(seq, token)
        # req.finished looks at every sibling: only ask when this one just ended.
        if seq.status is SequenceStatus.FINISHED and req.finished_time is None and req.finished:
            req.finished_time = now if now is not None else time.monotonic()

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_out = num_tokens - seq.num_prompt_tokens
        reason: FinishReason | None = None
        stop_reason: int | str | None = None
        if num_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason = FinishReason.STOP
            elif p.stop_token_ids and token in p.stop_token_ids:
                reason, stop_reason = FinishReason.STOP, token
        detok = seq.detokenizer
        if detok is not None and (reason is None or p.include_stop_str_in_output):
            new_text = detok.add_token(token)
            if reason is None and num_out >= p.min_tokens and p.stop_strings:
                hit = find_stop_string(
                    detok.output_text, len(new_text), p.stop_strings, p.include_stop_str_in_output
                )
                if hit is not None:
                    stop_reason, keep = hit
                    detok.truncate(keep)
                    reason = FinishReason.STOP
        if reason is None and p.structured_outputs is not None and self.structured.terminated(seq):
            reason = FinishReason.STOP  # the grammar is complete (it accepted a stop token)
        if reason is None:
            limit = p.max_tokens if p.max_tokens is not None else self.max_model_len
            if num_out >= limit or num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        if reason is not None:
            self._finish(seq, reason, stop_reason)

    def _finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        self.scheduler.finish(seq, reason, stop_reason)
        self.runner.release(seq)
        self.structured.release(seq)

    # ------------------------------------------------------------ logprobs
    def _decoded(self, token_id: int, seq_params_detok: bool) -> str | None:
        if self.tok is None or not seq_params_detok:
            return None
        return self.tok.decode_one(token_id)

    def _logprob_dict(self, token: int, lp: TokenLogprobs, detok: bool) -> dict[int, Logprob]:
        entry = {token: Logprob(lp.logprob, lp.rank, self._decoded(token, detok))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, self._decoded(tid, detok))
        return entry

    def _add_logprobs(self, seq: Sequence, token: int, lp: TokenLogprobs) -> None:
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(self._logprob_dict(token, lp, seq.params.detokenize))
        seq.cumulative_logprob += lp.logprob

    def add_prompt_logprobs(self, req: Request, entries: list[PromptTokenLogprob]) -> None:
        for entry in entries:
            # A recompute after preemption yields positions already recorded.
            if entry.position == len(req.prompt_logprobs):
                req.prompt_logprobs.append(
                    self._logprob_dict(entry.token_id, entry.logprob, req.params.detokenize)
                )

    # ------------------------------------------------------------- outputs
    def make_output(self, req: Request) -> RequestOutput | None:
        """The request's output per its ``output_kind`` (None: nothing to say yet).

        Built for every streaming request every step, so it stays lean: only the
        tail of a DELTA output is sliced, and no Sequence property is used.
        """
        kind = req.params.output_kind
        finished = req.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = []
        for seq in req.seqs:
            if delta and seq.finish_reported:
                continue  # a finished completion of an n > 1 request: nothing new
            completions.append(_completion(seq, delta, req.stop_holdback))
        prompt_logprobs = req.prompt_logprobs
        if delta and prompt_logprobs is not None:
            # Streaming sends the prompt's logprobs once, with the first output.
            prompt_logprobs = None if req.prompt_logprobs_reported else prompt_logprobs
            req.prompt_logprobs_reported = True
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            prompt_logprobs,
            completions,
            finished,
            max(0, req.seqs[0].num_cached_tokens),
            RequestMetrics(
                req.arrival_time, req.first_token_time, req.finished_time, req.first_scheduled_time
            ),
            req.error,
        )


def _completion(seq, delta: bool, holdback: int) -> CompletionOutput:
    """One sequence's output: what is new since its last report (``delta``), or
    all of it; text held back where a stop string may still complete."""
    seq_finished = seq.status is SequenceStatus.FINISHED
    detok = seq.detokenizer
    text = detok.output_text if detok is not None else ""
    text_end = len(text) if seq_finished or not holdback else len(text) - holdback
    reported_text = seq.num_text_reported
    text_end = max(text_end, reported_text)
    token_ids = seq.token_ids
    num_prompt = seq.num_prompt_tokens
    lps = seq.logprobs
    if delta:
        # Only what is new: slices of the tail, never of the whole output.
        reported = seq.num_tokens_reported
        out_text = text[reported_text:text_end] if text else ""
        out_ids = token_ids[num_prompt + reported :]
        out_lps = lps[reported:] if lps is not None else None
    else:
        out_text = text[:text_end]
        out_ids = token_ids[num_prompt:]
        out_lps = list(lps) if lps is not None else None
    seq.num_text_reported = text_end
    seq.num_tokens_reported = len(token_ids) - num_prompt
    seq.finish_reported = seq_finished
    reason = seq.finish_reason
    return CompletionOutput(
        seq.index,
        out_text,
        out_ids,
        seq.cumulative_logprob if lps is not None else None,
        out_lps,
        reason.value if reason is not None else None,
        seq.stop_reason,
    )
