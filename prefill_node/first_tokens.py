"""A prompt's first token on the KV channel, behind its last chunk (protocol.FLAG_TOKEN).

The first token (and its logprobs, where the request asked) is the one thing
of a Prefill the decode node needs besides the KV, and it leaves from the
device right behind the sampling, with no host in between: the decode node
starts decoding as soon as the KV and the token landed. The Prefill's reply
(its figures) goes to the router, and nothing waits for it.

The streamer announces the token in the segment's header when it prepares the
step's groups (``add``); the engine calls it back with the step's samples
(``send``, engine/kv_writes.py), and each announced token is queued on its
group's link after the group's chunks.
"""

from __future__ import annotations

import time

import torch

from common.kv_transfer.protocol import first_token_words


class FirstTokens:
    """One step's first tokens still to send (engine thread only)."""

    def __init__(self, sender) -> None:
        self.sender = sender
        self._due: list[tuple] = []  # (group, segment, batch row, logprobs), in wire order

    def clear(self) -> None:
        self._due = []

    def add(self, group, segment, row: int, logprobs: int) -> None:
        """``logprobs``: how many best tokens go with the token's own logprob (-1: none)."""
        self._due.append((group, segment, row, logprobs))

    def send(self, samples, rows: list[int]) -> None:
        """``samples``: the step's DeviceSamples (engine/layers/sampler.py), on the
        device; ``samples.token_ids[j]`` is batch row ``rows[j]``'s sample. A row
        that did not sample (never expected) sends -1, which the decode node
        reads as a failed transfer: its group announced a message, and the
        channel stays in step only if one comes."""
        due, self._due = self._due, []
        if not due:
            return
        token_ids = samples.token_ids
        messages = []
        for _, _, row, logprobs in due:
            if row not in rows:
                token = torch.full((1,), -1, dtype=torch.int64, device=token_ids.device)
                messages.append(first_token_words(token, _no_logprobs(logprobs, token)))
                continue
            j = rows.index(row)
            token = token_ids[j : j + 1]
            lp = _logprobs_of(samples, j, logprobs) if logprobs >= 0 else None
            messages.append(first_token_words(token, lp))
        ready = None
        if token_ids.is_cuda:
            # Behind the sampling and the fills above: the link's stream waits for it.
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
        now = time.monotonic()
        for (group, segment, _, _), words in zip(due, messages, strict=True):
            self.sender.send_chunk(group, segment, None, words, ready, now, False)


def _logprobs_of(samples, j: int, k: int) -> tuple[torch.Tensor, ...]:
    """Sampled row ``j``'s (logprob, rank, best k ids, their logprobs), on the device."""
    at = samples.logprob_rows.index(j)
    chosen, rank, top_ids, top_lp = samples.logprob_tensors
    return chosen[at], rank[at], top_ids[at, :k], top_lp[at, :k]


def _no_logprobs(k: int, like: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Logprob words of the announced size for a token that was never sampled."""
    if k < 0:
        return None
    zeros = torch.zeros(1, dtype=torch.float64, device=like.device)
    ids = torch.zeros(k, dtype=torch.int64, device=like.device)
    return zeros, zeros.to(torch.int64), ids, torch.zeros(k, device=like.device)
