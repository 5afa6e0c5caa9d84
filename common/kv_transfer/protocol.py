"""The KV stream's wire format: segment headers and the chunks they announce. No pickle.

A *segment* is the KV that one prefill step made for one request (all of it,
or a range of its layers), bound for one reservation: blocks ``[block_start,
block_end)`` of the prompt's block table, over layers ``[layer_start,
layer_end)`` and KV heads ``[head_start, head_end)``.
It travels as *chunks* of ``layers_per_chunk`` layers each, in layer order; a
chunk is one message of ``[2, layers, blocks, block_size, heads, head_dim]``
(``gather_blocks``'s layout) sent as bytes. Its size is ``units x unit_bytes``,
a unit being one block of one layer of one head, K and V.

A *group* is the segments of one step bound for one pair channel. Ordering rule
(NCCL and gloo match a pair's sends and receives in posting order, and sizes
must agree): the sender emits a group's k headers (16 int64 words each, the
first saying k), then its chunks in ``wire_order``: chunk 0 of every segment in
header order, then chunk 1 of every segment, and so on. The headers travel as
one *block* message of ``HEADER_BLOCK`` rows (zero rows after the k-th), and
those past the block in one more: the receiver keeps a block's receive posted
and learns k from its first row, so a group of up to ``HEADER_BLOCK`` segments
costs it one host round trip before its chunks' receives, not k. The receiver
derives the same order and every size from the headers alone, so it posts all
of the group's receives as soon as the headers arrived. The sender emits the
headers just before the step's first chunk (on a CPU when the step is
launched) and chunk c only after its layers ran; a chunk's send waits for its
receive. Groups never interleave: a group's headers go out only after every
chunk of the group before it.

A segment with flag TOKEN is its prompt's last (of the pair channel between
both nodes' rank 0) and carries the prompt's first token: after the group's
chunks comes one message per such segment, in header order, of
``token_message_bytes(header)``: the token the prefill node sampled after the
prompt's last layer, and, with flag LOGPROBS, its logprob, rank and the
header's ``top_logprobs`` best tokens with theirs (``first_token_words``). The
header's ``cached_tokens`` says how many prompt tokens the prefill node served
from its prefix cache. This is the one way a first token reaches the decode
node: it leaves from the device right behind the sampling.

An *end* header (flag END, no blocks, no chunks, a group of its own) closes a
reservation's stream on one pair channel: each sending rank of the prefill node
sends one, naming the KV heads it was to send, to each decode rank it pairs
with, for every Prefill it handled, after all of that request's chunks on that
channel, whatever became of the request. With ``--verify-kv`` it carries the
chained checksum of every chunk sent (``digest``). Until it arrives the decode
node keeps a receive posted for that peer, so a segment the prefill node sent
before it learnt of a cancellation is read and dropped instead of blocking the
channel.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.version import PROTOCOL_VERSION

# "pdsvkv" and the protocol version (common/version.py) in the low bits.
MAGIC = 0x7064_7376_6B76_0000 | PROTOCOL_VERSION
HEADER_WORDS = 16
HEADER_BLOCK = 8  # header rows in a group's first message (1 KiB)
FLAG_END = 1
FLAG_TOKEN = 2
FLAG_LOGPROBS = 4  # with FLAG_TOKEN: the token's logprobs follow it
MAX_TOP_LOGPROBS = 1 << 10

# Sanity bounds on what a header may announce (a corrupt stream must not make
# the receiver allocate terabytes; real values are far below these).
MAX_BLOCKS = 1 << 24
MAX_LAYERS = 1 << 12
MAX_HEADS = 1 << 12
MAX_UNIT_BYTES = 1 << 30
MAX_GROUP = 1 << 12
MAX_TOKENS = 1 << 40


class TransferState(enum.Enum):
    """Where one request's KV transfer stands (tracked by both nodes)."""

    RESERVED = enum.auto()  # decode node: blocks reserved, prefill requested
    STREAMING = enum.auto()  # decode node: segments announced, chunks landing
    SENDING = enum.auto()  # prefill node: segments queued or on the wire
    SENT = enum.auto()  # prefill node: every chunk of the request is out
    LANDED = enum.auto()  # decode node: every block of every layer scattered
    COMMITTED = enum.auto()  # decode node: the sequence joined the running batch
    FAILED = enum.auto()  # channel error, bad header or deadline: blocks freed on both sides
    ABORTED = enum.auto()  # cancelled: blocks freed on both sides
    EXPIRED = enum.auto()  # decode node: the reservation's lease ran out


@dataclass(slots=True, frozen=True)
class ChunkDesc:
    """One message of a segment: layers x blocks x heads (ranges are [start, end))."""

    layer_start: int
    layer_end: int
    block_start: int
    block_end: int
    head_start: int
    head_end: int

    @property
    def layers(self) -> tuple[int, int]:
        return self.layer_start, self.layer_end

    @property
    def heads(self) -> tuple[int, int]:
        return self.head_start, self.head_end

    @property
    def units(self) -> int:
        return (
            (self.layer_end - self.layer_start)
            * (self.block_end - self.block_start)
            * (self.head_end - self.head_start)
        )


@dataclass(slots=True, frozen=True)
class SegmentHeader:
    reservation_id: int  # chosen by the decode node: names the reserved blocks
    block_start: int  # prompt blocks [block_start, block_end)
    block_end: int
    layer_start: int = 0
    layer_end: int = 1
    layers_per_chunk: int = 1
    head_start: int = 0
    head_end: int = 1
    unit_bytes: int = 0  # bytes of one block x layer x head, K and V (a layout check)
    group_size: int = 1  # headers in this group
    group_index: int = 0  # this header's place in it
    # FLAG_END: the stream ends here (no blocks); FLAG_TOKEN: a first token
    # follows (FLAG_LOGPROBS: with its logprobs)
    flags: int = 0
    cached_tokens: int = 0  # FLAG_TOKEN: prompt tokens the prefill node had cached
    top_logprobs: int = 0  # FLAG_LOGPROBS: how many best tokens follow the token's own
    digest: bytes = b""  # FLAG_END with --verify-kv: the chunks' chained checksum (16 bytes)

    @classmethod
    def end(
        cls, reservation_id: int, heads: tuple[int, int] = (0, 0), digest: bytes = b""
    ) -> SegmentHeader:
        """The end of one sender's stream for a reservation: of these KV heads
        (a tensor-parallel prefill rank sends only some; each sends its own end)."""
        return cls(
            reservation_id, 0, 0, 0, 0, 1, heads[0], heads[1], 0, flags=FLAG_END, digest=digest
        )

    @property
    def is_end(self) -> bool:
        return bool(self.flags & FLAG_END)

    @property
    def has_token(self) -> bool:
        return bool(self.flags & FLAG_TOKEN)

    @property
    def has_logprobs(self) -> bool:
        return bool(self.flags & FLAG_LOGPROBS)

    @property
    def heads(self) -> tuple[int, int]:
        return self.head_start, self.head_end

    def chunks(self) -> list[ChunkDesc]:
        if self.is_end:
            return []
        step = self.layers_per_chunk
        return [
            ChunkDesc(
                lo,
                min(lo + step, self.layer_end),
                self.block_start,
                self.block_end,
                self.head_start,
                self.head_end,
            )
            for lo in range(self.layer_start, self.layer_end, step)
        ]

    @property
    def num_bytes(self) -> int:
        return sum(c.units for c in self.chunks()) * self.unit_bytes

    def with_group(self, size: int, index: int) -> SegmentHeader:
        return dataclasses.replace(self, group_size=size, group_index=index)

    def words(self) -> list[int]:
        return [
            MAGIC,
            self.reservation_id,
            self.block_start,
            self.block_end,
            self.layer_start,
            self.layer_end,
            self.layers_per_chunk,
            self.head_start,
            self.head_end,
            self.unit_bytes,
            self.group_size,
            self.group_index,
            self.flags,
            self.cached_tokens,
            *(_digest_words(self.digest) if self.is_end else (self.top_logprobs, 0)),
        ]

    def padded_words(self) -> list[int]:
        return self.words()

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(self.padded_words(), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> SegmentHeader:
        return cls.from_words(t.tolist())

    @classmethod
    def from_words(cls, words: list[int]) -> SegmentHeader:
        """Parse and bound-check; ValueError for anything that is not a sane header."""
        if len(words) != HEADER_WORDS or words[0] != MAGIC:
            raise ValueError(
                f"not a KV segment header of protocol version {PROTOCOL_VERSION} "
                f"(magic {words[0]:#x}, expected {MAGIC:#x})"
            )
        header = cls(*words[1:14])
        if header.is_end:
            digest = b"".join(w.to_bytes(8, "little", signed=True) for w in words[14:16])
            header = dataclasses.replace(header, digest=b"" if not any(digest) else digest)
        else:
            header = dataclasses.replace(header, top_logprobs=words[14])
        header._check()
        return header

    def _check(self) -> None:
        end = self.is_end
        ok = (
            0 <= self.group_index < self.group_size <= MAX_GROUP
            and self.reservation_id >= 0
            and (end or 0 <= self.block_start < self.block_end <= MAX_BLOCKS)
            and (end or 0 <= self.layer_start < self.layer_end <= MAX_LAYERS)
            and 0 <= self.head_start <= self.head_end <= MAX_HEADS
            and (end or self.head_start < self.head_end)
            and (end or 0 < self.unit_bytes <= MAX_UNIT_BYTES)
            and self.layers_per_chunk >= 1
            and self.flags & ~(FLAG_END | FLAG_TOKEN | FLAG_LOGPROBS) == 0
            and not (end and self.has_token)
            and (self.has_token or not self.has_logprobs)
            and 0 <= self.cached_tokens <= MAX_TOKENS
            and (self.has_token or self.cached_tokens == 0)
            and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
            and (self.has_logprobs or self.top_logprobs == 0)
        )
        if not ok:
            raise ValueError(f"KV segment header out of bounds: {self}")


def wire_order(headers: Sequence[SegmentHeader]) -> list[tuple[int, ChunkDesc]]:
    """A group's chunks in the order they travel: (segment index, chunk)."""
    per_segment = [h.chunks() for h in headers]
    order: list[tuple[int, ChunkDesc]] = []
    for c in range(max((len(chunks) for chunks in per_segment), default=0)):
        order.extend((i, chunks[c]) for i, chunks in enumerate(per_segment) if c < len(chunks))
    return order


def token_order(headers: Sequence[SegmentHeader]) -> list[int]:
    """The segments (indices) whose first token follows a group's chunks, in the order they travel."""
    return [i for i, h in enumerate(headers) if h.has_token]


def header_message_rows(group_size: int) -> list[int]:
    """How a group's headers travel, both sides' one rule: the rows of each
    message in order, ``HEADER_BLOCK`` rows (zeros after the last header) and
    those past it in one more."""
    return [HEADER_BLOCK] + ([group_size - HEADER_BLOCK] if group_size > HEADER_BLOCK else [])


def header_words(headers: Sequence[SegmentHeader]) -> tuple[torch.Tensor, list[int]]:
    """A group's headers as the rows of ``HEADER_WORDS`` its messages carry,
    with each message's rows (``header_message_rows``)."""
    sizes = header_message_rows(len(headers))
    rows = [h.padded_words() for h in headers]
    rows += [[0] * HEADER_WORDS] * (sum(sizes) - len(rows))
    return torch.tensor(rows, dtype=torch.int64), sizes


def token_message_bytes(header: SegmentHeader) -> int:
    """The size of the first-token message a TOKEN segment announces: the
    token; with logprobs, its rank, its logprob and the best tokens' ids and logprobs."""
    words = 3 + 2 * header.top_logprobs if header.has_logprobs else 1
    return 8 * words


def first_token_words(
    token: torch.Tensor, logprobs: tuple[torch.Tensor, ...] | None = None
) -> torch.Tensor:
    """The first-token message as int64 words, built on the tokens' device: the
    token (a one-element tensor); with ``logprobs`` = (its logprob, its rank, the
    best ids, their logprobs), one row of each, the rank and the logprobs'
    float64 bit patterns after it. The sizes agree with ``token_message_bytes``."""
    parts = [token.reshape(1).to(torch.int64)]
    if logprobs is not None:
        chosen, rank, top_ids, top_lp = logprobs
        parts += [
            rank.reshape(1).to(torch.int64),
            chosen.reshape(1).to(torch.float64).view(torch.int64),
            top_ids.reshape(-1).to(torch.int64),
            top_lp.reshape(-1).to(torch.float64).view(torch.int64),
        ]
    return torch.cat(parts)


@dataclass(slots=True, frozen=True)
class FirstToken:
    """What a first-token message says (decoded on the host)."""

    token_id: int  # -1: the prefill node sampled none for this prompt
    cached_tokens: int
    # (logprob, rank, best ids, their logprobs), where the header announced them.
    logprobs: tuple[float, int, list[int], list[float]] | None = None


def parse_first_token(header: SegmentHeader, data: bytes) -> FirstToken:
    words = torch.frombuffer(bytearray(data), dtype=torch.int64)
    token_id = int(words[0])
    if not header.has_logprobs:
        return FirstToken(token_id, header.cached_tokens)
    k = header.top_logprobs
    floats = words.view(torch.float64)
    logprobs = (
        float(floats[2]),
        int(words[1]),
        words[3 : 3 + k].tolist(),
        floats[3 + k :].tolist(),
    )
    return FirstToken(token_id, header.cached_tokens, logprobs)


def group_messages(headers: Sequence[SegmentHeader]) -> int:
    """How many messages follow a group's headers: its chunks, then its tokens."""
    return len(wire_order(headers)) + len(token_order(headers))


def _digest_words(digest: bytes) -> tuple[int, int]:
    padded = digest.ljust(16, b"\0")
    return tuple(int.from_bytes(padded[i : i + 8], "little", signed=True) for i in (0, 8))
