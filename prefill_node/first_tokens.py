"""A prompt's first token on the KV channel, behind its last chunk (protocol.FLAG_TOKEN).

A decode node that asked for it (``PrefillRequest.first_token_on_kv``) can
start decoding as soon as the KV and the token landed, without waiting for the
Prefill's reply: that reply waits for this node's host to see the step end,
then crosses its event loop and a gRPC message (0.6-0.9 ms at 2048 tokens on
the GPU host, docs/performance.md), while the token leaves from the device
right behind the sampling. The reply still comes (timings, and the token for
a decode node that did not ask).

The streamer announces the token in the segment's header when it prepares the
step's groups (``add``); the engine calls it back with the step's samples
(``send``, engine/kv_writes.py), and each announced token is queued on its
group's link after the group's chunks.
"""

from __future__ import annotations

import time

import torch


class FirstTokens:
    """One step's first tokens still to send (engine thread only)."""

    def __init__(self, sender) -> None:
        self.sender = sender
        self._due: list[tuple] = []  # (group, segment, batch row), in wire order

    def clear(self) -> None:
        self._due = []

    def add(self, group, segment, row: int) -> None:
        self._due.append((group, segment, row))

    def send(self, token_ids: torch.Tensor, rows: list[int]) -> None:
        """``token_ids[j]``: batch row ``rows[j]``'s sample, on the device. A row
        that did not sample (never expected) sends -1, which the decode node
        reads as "take the reply's": its group announced a message, and the
        channel stays in step only if one comes."""
        due, self._due = self._due, []
        if not due:
            return
        tokens = []
        for _, _, row in due:
            if row in rows:
                j = rows.index(row)
                tokens.append(token_ids[j : j + 1])
            else:
                tokens.append(torch.full((1,), -1, dtype=torch.int64, device=token_ids.device))
        ready = None
        if token_ids.is_cuda:
            # Behind the sampling and the fills above: the link's stream waits for it.
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
        now = time.monotonic()
        for (group, segment, _), token in zip(due, tokens, strict=True):
            self.sender.send_chunk(group, segment, None, token, ready, now, False)
