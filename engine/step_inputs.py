"""One step's model inputs: built as numpy arrays on the host, sent in one copy.

Everything a forward reads (token ids, positions, slot mapping, sequence
lengths, query start locations, block tables) and the few index arrays a step
needs besides (where to write the previous step's device-side samples, which
hidden rows to sample from) is computed with numpy, without a Python loop per
token or per block, then packed into one pinned host buffer and sent with ONE
non-blocking host-to-device copy. The device tensors are views of that copy.

The pinned buffers are persistent: a small ring of them, each reused only
after the copy that last read it has finished (an event per buffer; with at
most one step in flight it is always finished already, so the wait is free).
The device side is a fresh tensor per call from torch's caching allocator, so
inputs built earlier stay valid (tests and benchmarks build several at once).
On a CPU the arrays become tensors without any copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.layers.attention import AttentionMetadata
from engine.model_io import ModelInputs

RING_SIZE = 4
ALIGN = 16  # bytes: every packed array starts aligned for any dtype view


class HostStaging:
    """Numpy arrays -> device tensors with one pinned, non-blocking copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * RING_SIZE
        self._events: list[torch.cuda.Event | None] = [None] * RING_SIZE
        self._next = 0

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets = []
        total = 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // ALIGN) * ALIGN
        slot = self._next
        self._next = (slot + 1) % RING_SIZE
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer is done
        buf = self._buffers[slot]
        if buf is None or buf.numel() < total:
            size = max(total, 2 * (buf.numel() if buf is not None else 0), 1 << 16)
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buf
        host = buf.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            host[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        dev.copy_(buf[:total], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[slot] = event
        out = []
        for a, off in zip(arrays, offsets, strict=True):
            dtype = _TORCH_DTYPES[a.dtype.type]
            out.append(dev[off : off + a.nbytes].view(dtype).view(a.shape))
        return out


_TORCH_DTYPES = {
    np.int64: torch.int64,
    np.int32: torch.int32,
    np.float32: torch.float32,
    np.bool_: torch.bool,
}


@dataclass(slots=True)
class HostInputs:
    """A step's inputs as host arrays (``to_model_inputs`` sends them)."""

    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    query_start_loc: np.ndarray  # int64 [num_seqs + 1]
    seq_lens: np.ndarray  # int64 [num_seqs]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def host_inputs(
    token_ids: list[list[int]],
    starts: list[int],
    num_new: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> HostInputs:
    """Sequence i contributes tokens ``token_ids[i][starts[i]:starts[i] + num_new[i]]``."""
    num_seqs = len(num_new)
    start = np.asarray(starts, dtype=np.int64)
    count = np.asarray(num_new, dtype=np.int64)
    ends = start + count
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(count, out=qsl[1:])
    total = int(qsl[-1])
    lens = np.fromiter(map(len, block_tables), np.int64, num_seqs)
    tables = np.zeros((num_seqs, max(int(lens.max()), 1)), dtype=np.int32)
    # Row-major boolean assignment fills each row's first len(table) entries.
    tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), np.int32, int(lens.sum())
    )
    if total == num_seqs:  # one token each: a decode step
        input_ids = np.fromiter(
            (ids[s] for ids, s in zip(token_ids, starts, strict=True)), np.int64, num_seqs
        )
        positions = start
        seq_index = np.arange(num_seqs)
    else:
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                ids[s:e] for ids, s, e in zip(token_ids, starts, ends.tolist(), strict=True)
            ),
            np.int64,
            total,
        )
        seq_index = np.repeat(np.arange(num_seqs), count)
        positions = np.arange(total, dtype=np.int64) + np.repeat(start - qsl[:-1], count)
    slots = tables[seq_index, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    return HostInputs(input_ids, positions, qsl, ends, slots, tables)


def to_model_inputs(
    host: HostInputs, staging: HostStaging, extra: list[np.ndarray] = ()
) -> tuple[ModelInputs, list[torch.Tensor]]:
    """Send the inputs (and ``extra`` arrays, in the same copy) to the device."""
    arrays = [
        host.input_ids,
        host.positions,
        host.slot_mapping,
        host.query_start_loc.astype(np.int32),
        host.seq_lens.astype(np.int32),
        host.block_tables,
        *extra,
    ]
    ids, positions, slots, qsl, seq_lens, tables, *rest = staging.to_device(arrays)
    count = np.diff(host.query_start_loc)
    not_one = np.flatnonzero(count != 1)
    meta = AttentionMetadata(
        num_seqs=host.num_seqs,
        num_tokens=host.num_tokens,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        slot_mapping=slots,
        block_tables=tables,
        max_query_len=int(count.max()),
        max_seq_len=int(host.seq_lens.max()),
        query_start_loc_cpu=host.query_start_loc.tolist(),
        seq_lens_cpu=host.seq_lens.tolist(),
        # Leading one-token rows (the scheduler puts running decodes first).
        num_decode_seqs=int(not_one[0]) if not_one.size else host.num_seqs,
    )
    return ModelInputs(ids, positions, meta), rest
