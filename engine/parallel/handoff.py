"""Rank 0's per-step hand-off to the other tensor-parallel ranks.

Rank 0 runs the scheduler; every other rank runs the same forward on the same
inputs and takes part in its collectives. Each step rank 0 publishes, in a
shared-memory channel (engine/parallel/shm_channel.py: a few microseconds,
where two gloo broadcasts over loopback cost about 400), what the followers
cannot know: the step's host
inputs (the arrays ``to_model_inputs`` sends to the device) and which logits
to compute (the sampled rows, the prompt-logprob slices), all packed as int64
words: a fixed header with the sizes, then one payload. No pickle, no Python
objects: a follower rebuilds the same ``HostInputs`` from the words.

What stays on rank 0: sampling (the followers compute their share of the
logits for the all-gather and drop the result), penalties, seeds, stop
checks, block bookkeeping, speculative decoding's acceptance (a verify
step's plan is a step's: its inputs hold the proposed tokens, its logit rows
every verified position; rejected positions' KV is never read again, so
nothing is rolled back on the followers). A draft model's forward is planned
the same way and sent as ``Op.DRAFT``. Async-scheduled input ids (the
previous step's samples, on rank 0's device only) reach the followers by a
device broadcast of the step's input ids, after the header says ``patched``.

With a host tier each rank holds its own heads of every slot, and rank 0's
bookkeeping decides the copies: each batch goes to the others as a message
of its own (``TierPlan``: the block and slot pairs, int64 words again) at
the point rank 0 issues it, so every rank copies the same ids between the
same two steps. A batch larger than the channel goes as several messages,
issued as one batch by the receiver. Each step's plan names how many batches
rank 0 had retired (``tier_landed``): a follower waits for its own up to
there before the forward, which may read blocks they loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.host_tier import TierCopies, TierPlan
from engine.lora.request import LoRARequest
from engine.parallel.group import TPGroup
from engine.parallel.shm_channel import ShmBroadcast
from engine.step_inputs import HostInputs


class Op(IntEnum):
    STEP = 1
    STOP = 2  # rank 0 is shutting down: followers leave their loop
    CALL = 3  # a method of the followers' worker extension, between two steps
    TIER = 4  # a batch of host-tier copies (part of one, unless the header says last)
    DRAFT = 5  # a STEP's plan for the draft model's forward (speculative decoding)


@dataclass(slots=True, frozen=True)
class Call:
    """``method(payload)`` on each follower's worker extension (engine/tp_workers.py).
    The payload is JSON (UTF-8), never pickle."""

    method: str
    payload: bytes


class Logits(IntEnum):
    """Which hidden rows a step computes logits for (sampling)."""

    NONE = 0  # no sequence samples (a prefill chunk that is not the last)
    ALL = 1  # every row samples (a decode step)
    ROWS = 2  # ``logit_rows``


@dataclass(slots=True)
class StepPlan:
    """What every rank needs to run one step's forward and logits identically."""

    host: HostInputs
    patched: bool = False  # input ids take rank 0's device-side samples
    use_graph: bool = False  # rank 0 replays a CUDA graph: so must the others
    logits: Logits = Logits.NONE
    logit_rows: np.ndarray | None = None  # int64 hidden rows, when ``logits`` is ROWS
    # Hidden-row slices [lo, hi) whose logits prompt logprobs read, in order.
    prompt_slices: list[tuple[int, int]] = field(default_factory=list)
    # LoRA: each token's adapter slot (int32, -1: none; None: no adapter in the
    # step), and the adapters to copy into their slots first.
    lora_slots: np.ndarray | None = None
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # Host-tier copy batches rank 0 had retired (TierPlan.landed's count).
    tier_landed: int = 0
    # The draft model's forward (engine/spec_decode/draft_model.py), not the
    # target's: sent as Op.DRAFT, the same words otherwise.
    draft: bool = False


# op, num_tokens, num_seqs, table_width, patched, use_graph, logits,
# num_logit_rows, num_prompt_slices, payload words, has LoRA slots, LoRA loads' bytes,
# host-tier batches landed
HEADER_WORDS = 13
# Room in a plan for the LoRA copies of one step (JSON: slot, name, id, path).
LORA_LOAD_BYTES = 8192


def _encode_lora(plan: StepPlan) -> tuple[np.ndarray, bytes]:
    if plan.lora_slots is None:
        return np.empty(0, np.int64), b""
    loads = [[slot, r.lora_name, r.lora_int_id, r.lora_path] for slot, r in plan.lora_loads]
    raw = json.dumps(loads).encode() if loads else b""
    return plan.lora_slots.astype(np.int64), raw


def _decode_lora(slots: np.ndarray, raw: bytes) -> tuple[np.ndarray, list]:
    loads = json.loads(raw) if raw else []
    return slots.astype(np.int32), [(s, LoRARequest(n, i, p)) for s, n, i, p in loads]


def encode(plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    h = plan.host
    rows = plan.logit_rows if plan.logit_rows is not None else np.empty(0, np.int64)
    slices = np.asarray(plan.prompt_slices, dtype=np.int64).reshape(-1)
    lora_slots, lora_raw = _encode_lora(plan)
    payload = np.concatenate(
        [
            h.input_ids,
            h.positions,
            h.slot_mapping,
            h.query_start_loc,
            h.seq_lens,
            h.block_tables.reshape(-1).astype(np.int64),
            rows.astype(np.int64, copy=False),
            slices,
            lora_slots,
            _words(lora_raw),
        ]
    )
    header = np.array(
        [
            Op.DRAFT if plan.draft else Op.STEP,
            h.num_tokens,
            h.num_seqs,
            h.block_tables.shape[1],
            plan.patched,
            plan.use_graph,
            plan.logits,
            len(rows),
            len(plan.prompt_slices),
            len(payload),
            plan.lora_slots is not None,
            len(lora_raw),
            plan.tier_landed,
        ],
        dtype=np.int64,
    )
    return header, payload


def decode(header: np.ndarray, payload: np.ndarray) -> StepPlan:
    (op, num_tokens, num_seqs, width, patched, use_graph, logits, num_rows, num_slices, _,
     has_lora, lora_bytes, tier_landed) = (int(x) for x in header)  # fmt: skip
    cuts = np.cumsum(
        [num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * width, num_rows,
         2 * num_slices, num_tokens if has_lora else 0]
    )  # fmt: skip
    ids, pos, slots, qsl, lens, tables, rows, slices, lora_slots, lora_raw = np.split(payload, cuts)
    host = HostInputs(
        input_ids=ids,
        positions=pos,
        query_start_loc=qsl,
        seq_lens=lens,
        slot_mapping=slots,
        block_tables=tables.astype(np.int32).reshape(num_seqs, width),
    )
    lora = _decode_lora(lora_slots, lora_raw.tobytes()[:lora_bytes]) if has_lora else (None, [])
    return StepPlan(
        host,
        lora_slots=lora[0],
        lora_loads=lora[1],
        patched=bool(patched),
        use_graph=bool(use_graph),
        logits=Logits(logits),
        logit_rows=rows if logits == Logits.ROWS else None,
        prompt_slices=[tuple(p) for p in slices.reshape(num_slices, 2).tolist()],
        tier_landed=tier_landed,
        draft=op == Op.DRAFT,
    )


def encode_tier(plan: TierPlan, capacity_words: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A batch of tier copies as (header, payload) messages of at most
    ``capacity_words`` each: its pairs (to the host first) split in order, the
    last message flagged. Header: op, pairs to the host, pairs to the device,
    landed, wait, last."""
    pairs = plan.copies.to_host + plan.copies.to_device
    per_message = max(1, (capacity_words - HEADER_WORDS) // 2)
    num_to_host = len(plan.copies.to_host)
    messages = []
    for lo in range(0, max(len(pairs), 1), per_message):
        hi = min(lo + per_message, len(pairs))
        to_host = max(0, min(hi, num_to_host) - lo)
        header = np.zeros(HEADER_WORDS, dtype=np.int64)
        header[:6] = (Op.TIER, to_host, hi - lo - to_host, plan.landed, plan.wait, hi == len(pairs))
        payload = np.asarray(pairs[lo:hi], dtype=np.int64).reshape(-1)
        messages.append((header, payload))
    return messages


def decode_tier(header: np.ndarray, payload: np.ndarray, into: TierCopies) -> TierPlan | None:
    """Add one message's pairs to ``into``; the whole plan once the last came."""
    _, to_host, to_device, landed, wait, last = (int(x) for x in header[:6])
    pairs = payload[: 2 * (to_host + to_device)].reshape(-1, 2).tolist()
    into.to_host.extend(tuple(p) for p in pairs[:to_host])
    into.to_device.extend(tuple(p) for p in pairs[to_host:])
    return TierPlan(into, landed, bool(wait)) if last else None


def max_plan_words(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> int:
    """The longest message a step of these limits can need (header included)."""
    slices = max_seqs + max_tokens // 1024 + 1  # prompt-logprob slices of <= 1024 rows
    return (
        HEADER_WORDS
        + 3 * max_tokens  # input ids, positions, slot mapping
        + 2 * max_seqs
        + 1
        + max_seqs * max_blocks_per_seq
        # Logit rows: one per sampled sequence, or a verify step's every
        # position of its proposals: at most one per token either way.
        + max_tokens
        + 2 * slices
        + max_tokens  # LoRA slots
        + LORA_LOAD_BYTES // 8
    )


def _words(data: bytes) -> np.ndarray:
    """Bytes as int64 words (zero-padded to a multiple of 8)."""
    return np.frombuffer(data + bytes(-len(data) % 8), dtype=np.int64)


class Handoff:
    """Both ends of the per-step channel: rank 0 ``send``s and ``stop``s, the
    others ``recv``. Rank 0 creates the shared-memory segment and publishes its
    name in the group's store; the others attach to it."""

    STORE_KEY = "handoff/shm"

    def __init__(
        self, group: TPGroup, capacity_words: int, alive: Callable[[], None] | None = None
    ) -> None:
        self.group = group
        self.alive = alive  # raises when the other side is gone
        readers = group.size - 1
        if group.is_driver:
            self.channel = ShmBroadcast.create(readers, capacity_words)
            group.store.set(self.STORE_KEY, self.channel.name)
        else:
            name = group.store.get(self.STORE_KEY).decode()
            self.channel = ShmBroadcast.attach(name, readers)

    def send(self, plan: StepPlan) -> None:
        header, payload = encode(plan)
        self.channel.write([header, payload], self.alive)

    def send_tier(self, plan: TierPlan) -> None:
        """Publish a batch of host-tier copies; the followers issue it before
        the next step's plan, as rank 0 does."""
        for header, payload in encode_tier(plan, self.channel.capacity):
            self.channel.write([header, payload], self.alive)

    def stop(self) -> None:
        header = np.zeros(HEADER_WORDS, dtype=np.int64)
        header[0] = Op.STOP
        self.channel.write([header], self.alive)

    def call(self, call: Call) -> None:
        """Publish a call; the followers run it before the next step's plan."""
        name = call.method.encode()
        header = np.zeros(HEADER_WORDS, dtype=np.int64)
        header[:3] = (Op.CALL, len(name), len(call.payload))
        self.channel.write([header, _words(name + call.payload)], self.alive)

    def recv(self) -> StepPlan | Call | TierPlan | None:
        """The next step's plan, call or batch of tier copies, or None when
        rank 0 stopped."""
        words = self.channel.read(self.group.rank - 1, self.alive)
        header, payload = words[:HEADER_WORDS], words[HEADER_WORDS:]
        if header[0] == Op.TIER:
            tier = TierCopies()
            while (plan := decode_tier(header, payload, tier)) is None:
                words = self.channel.read(self.group.rank - 1, self.alive)
                header, payload = words[:HEADER_WORDS], words[HEADER_WORDS:]
                if header[0] != Op.TIER:
                    raise RuntimeError("tensor-parallel hand-off: a tier batch cut short")
            return plan
        if header[0] == Op.STOP:
            return None
        if header[0] == Op.CALL:
            name_len, payload_len = int(header[1]), int(header[2])
            raw = payload.tobytes()
            return Call(raw[:name_len].decode(), raw[name_len : name_len + payload_len])
        if header[0] not in (Op.STEP, Op.DRAFT):
            raise RuntimeError(f"tensor-parallel hand-off out of step: header {header.tolist()}")
        return decode(header, payload)

    def close(self, unlink: bool | None = None) -> None:
        if self.channel.words is not None:
            self.channel.close(unlink)
