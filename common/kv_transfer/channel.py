"""A pairwise process group (rank 0 sends, rank 1 receives), gloo on CPU, NCCL on CUDA."""

from __future__ import annotations

import contextlib
import datetime
import time

import torch
import torch.distributed as dist

from common.kv_transfer.protocol import HEADER_WORDS, TransferHeader

SENDER, RECEIVER = 0, 1


class TransferError(RuntimeError):
    """A transfer failed (peer gone, deadline passed, bad header); the channel is unusable."""


class DeadlinePassed(TransferError):
    """The request's deadline passed before its transfer started; the channel is fine."""


class PairChannel:
    def __init__(
        self, store: dist.Store, key: str, rank: int, device: torch.device, timeout_s: float
    ) -> None:
        self.device = device
        self.rank = rank
        self.peer = 1 - rank
        self.timeout_s = timeout_s
        prefixed = dist.PrefixStore(key, store)
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                # Our own deadlines abort the group first; NCCL's watchdog (which
                # would tear the process down) only backs them up.
                opts._timeout = max(timeout, datetime.timedelta(minutes=10))
                self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
            else:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        except Exception as e:
            raise TransferError(f"pair channel {key} could not connect: {e}") from e
        self._header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=device)
        self.closed = False

    # ----------------------------------------------------------------- sending
    def send(
        self, header: TransferHeader, payload: torch.Tensor, deadline: float, pause_s: float = 0.0
    ) -> None:
        """Header, then payload (any dtype; sent as bytes). Blocks until both are out.

        ``deadline`` (the request's) is checked before the header only: once the
        header is out the payload follows whatever the request's fate, because
        the receiver reads exactly what the header announces and a stream left
        half-way would break the next transfer. The channel's timeout still
        bounds it. ``pause_s`` holds the transfer between the two (fault tests).
        """
        if time.monotonic() > deadline:
            raise DeadlinePassed("KV transfer deadline passed before sending")
        limit = time.monotonic() + self.timeout_s
        self._wait(self.pg.send([header.to_tensor().to(self.device)], self.peer, 0), limit)
        if pause_s:
            time.sleep(pause_s)
        if header.num_bytes:
            limit = time.monotonic() + self.timeout_s
            self._wait(self.pg.send([_bytes_view(payload)], self.peer, 0), limit)

    # --------------------------------------------------------------- receiving
    def recv_header(self, deadline: float) -> TransferHeader:
        self._wait(self.pg.recv([self._header], self.peer, 0), deadline)
        try:
            return TransferHeader.from_tensor(self._header.cpu())
        except ValueError as e:
            raise TransferError(str(e)) from e

    def recv_payload(self, num_bytes: int, deadline: float) -> torch.Tensor:
        buf = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        if num_bytes:
            self._wait(self.pg.recv([buf], self.peer, 0), deadline)
        return buf

    # ---------------------------------------------------------------- plumbing
    def _wait(self, work: dist.Work, deadline: float) -> None:
        try:
            if self.device.type == "cuda":
                # NCCL work completes asynchronously on a stream: poll it against
                # the deadline instead of blocking in wait().
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TransferError("KV transfer deadline passed")
                    time.sleep(0.0002)
                work.wait()
            else:
                work.wait()  # gloo raises after the group's timeout
        except TransferError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise TransferError(f"KV transfer failed: {e}") from e

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        abort = getattr(self.pg, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            with contextlib.suppress(Exception):  # best effort on a broken group
                abort()


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)
