"""A pairwise process group (rank 0 sends, rank 1 receives), gloo on CPU, NCCL on CUDA.

It moves messages and nothing else: a group's segment headers (rows of 16 int64 words) and
chunks (any tensor, sent as its bytes). Which message comes when is the
protocol's business (protocol.py); every wait here has a deadline, and any
failure closes the channel for good (the epoch moves on and a new one is built).

Building one: both ranks must be in the rendezvous at once, and the two nodes
get there at unrelated times (the decode node when it reserves, the prefill
node when the prompt's first step launches, which a busy prefill node may
delay by far more than any connect timeout). So the sender announces itself
under ``ready_key`` just before it joins, and the receiver joins only once that
key is there: the rendezvous itself then takes milliseconds, and
``connect_timeout_s`` (short, apart from the transfer timeout) bounds a
channel that cannot be built. A receiver that leaves an epoch marks it under
``closed_key``: a sender never waits in a rendezvous nobody will join.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import torch
import torch.distributed as dist

from common.kv_transfer.protocol import (
    HEADER_BLOCK,
    HEADER_WORDS,
    SegmentHeader,
    header_message_rows,
    header_words,
)

SENDER, RECEIVER = 0, 1
# NCCL work completes asynchronously on a stream: the host polls it this often.
POLL_S = 0.00005


def pair_key(sender_node: str, sender_rank: int, receiver_rank: int, epoch: int) -> str:
    """The rendezvous key of one pair channel: a prefill node's rank and a
    decode node's rank (whose rank 0 hosts the store), under one epoch."""
    return f"pair/{sender_node}/{sender_rank}-{receiver_rank}/{epoch}"


def ready_key(key: str) -> str:
    """Set by the sender just before it joins the rendezvous of ``key``."""
    return f"{key}:ready"


def closed_key(key: str) -> str:
    """Set by the receiver once it left (or never will join) the channel of ``key``."""
    return f"{key}:closed"


class TransferError(RuntimeError):
    """A transfer failed (peer gone, deadline passed, bad header); the channel is unusable."""


class EpochLeft(TransferError):
    """The receiver left this channel epoch (``closed_key``): nothing more goes out on it."""


class DeadlinePassed(TransferError):
    """The request's deadline passed before its transfer started; the channel is fine."""


class PairChannel:
    """``store``'s own timeout bounds the rendezvous on NCCL (its first
    operation reads the peer's id from the store); ``connect_timeout_s`` bounds
    gloo's. Every transfer wait after that passes its own deadline."""

    def __init__(
        self,
        store: dist.Store,
        key: str,
        rank: int,
        device: torch.device,
        connect_timeout_s: float,
    ) -> None:
        self.device = device
        self.rank = rank
        self.peer = 1 - rank
        prefixed = dist.PrefixStore(key, store)
        connect = datetime.timedelta(seconds=connect_timeout_s)
        try:
            if device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                # Our own deadlines abort the group first; NCCL's watchdog (which
                # would tear the process down) only backs them up.
                opts._timeout = datetime.timedelta(minutes=10)
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, connect)
        except Exception as e:
            raise TransferError(f"pair channel {key} could not connect: {e}") from e
        self._block = torch.empty(HEADER_BLOCK, HEADER_WORDS, dtype=torch.int64, device=device)
        self.closed = False

    # ----------------------------------------------------------------- sending
    def send_headers(self, headers: list[SegmentHeader]) -> list[dist.Work]:
        """Post a group's headers, framed as a block (protocol.py)."""
        words, sizes = header_words(headers)
        # One copy to the device for all of them, then a view per message.
        return [self.pg.send([m], self.peer, 0) for m in words.to(self.device).split(sizes)]

    def send(self, data: torch.Tensor) -> dist.Work:
        """Post one message: ``data``'s bytes (the caller keeps ``data`` alive until done)."""
        return self.pg.send([_bytes_view(data)], self.peer, 0)

    # --------------------------------------------------------------- receiving
    def recv_group(self, deadline: float) -> list[SegmentHeader]:
        """A group's headers, framed as a block (protocol.py): the first says how
        many there are."""
        first_rows = self._block
        self.wait(self.pg.recv([first_rows], self.peer, 0), deadline)
        got = first_rows.cpu()
        first = self._parse(got[0])
        if first.group_index != 0:
            self.close()
            raise TransferError(f"KV stream out of step: a group starts with {first}")
        size = first.group_size
        rows = list(got[1:size])
        if rest_sizes := header_message_rows(size)[1:]:
            rest = torch.empty(sum(rest_sizes), HEADER_WORDS, dtype=torch.int64, device=self.device)
            works = [self.pg.recv([m], self.peer, 0) for m in rest.split(rest_sizes)]
            for work in works:
                self.wait(work, deadline)
            rows.extend(rest.cpu())
        headers = [first] + [self._parse(row) for row in rows]
        for i, h in enumerate(headers):
            if h.group_index != i or h.group_size != first.group_size:
                self.close()
                raise TransferError(f"KV stream out of step: header {i} of a group is {h}")
        return headers

    def post_recv(self, buf: torch.Tensor) -> dist.Work:
        return self.pg.recv([buf], self.peer, 0)

    def _parse(self, t: torch.Tensor) -> SegmentHeader:
        try:
            return SegmentHeader.from_tensor(t)
        except ValueError as e:
            self.close()
            raise TransferError(str(e)) from e

    # ---------------------------------------------------------------- plumbing
    def wait(self, work: dist.Work, deadline: float) -> None:
        """Until ``work`` completed; TransferError (and the channel closed) on a
        failure or when ``deadline`` passes."""
        try:
            if self.device.type == "cuda":
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TransferError("KV transfer deadline passed")
                    time.sleep(POLL_S)
                work.wait()  # orders the current stream after the transfer
            else:
                # gloo cannot be polled; a timed-out wait leaves the pair closed.
                left = max(0.001, deadline - time.monotonic())
                work.wait(datetime.timedelta(seconds=left))
        except TransferError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise TransferError(f"KV transfer failed: {e}") from e

    def close(self) -> None:
        """For good. The group goes with it: gloo closes its connections only
        when the group is destroyed (not on abort), and then the peer's posted
        operations fail at once instead of waiting out their deadlines."""
        if self.closed:
            return
        self.closed = True
        abort = getattr(self.pg, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            with contextlib.suppress(Exception):  # best effort on a broken group
                abort()
        self.pg = _CLOSED


class _Closed:
    """A closed channel's group: any use is a TransferError, never a hang."""

    def __getattr__(self, name: str):
        raise TransferError("the KV channel is closed")


_CLOSED = _Closed()


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)
