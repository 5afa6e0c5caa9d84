"""What the benchmark sends: random, shared-prefix, multi-turn, json-schema and jsonl prompts.

Prompts are token ids where possible (every length is then exact and no
tokenizer is needed); ``--prompt-format text`` sends words instead, for servers
that take only text (a word is about one token).
"""

from __future__ import annotations

import enum
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Clear of the lowest and highest ids, where special tokens live.
_LOW_ID_MARGIN = 300


class DatasetKind(enum.Enum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    MULTI_TURN = "multi-turn"
    JSON_SCHEMA = "json-schema"
    JSONL = "jsonl"

    def __str__(self) -> str:  # argparse shows choices by str()
        return self.value


class PromptFormat(enum.Enum):
    TOKEN_IDS = "token-ids"
    TEXT = "text"

    def __str__(self) -> str:  # argparse shows choices by str()
        return self.value


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens (words for text prompts; the server's usage corrects it)
    output_len: int
    # multi-turn: the conversation this turn belongs to and its position in it.
    conversation: int = -1
    turn: int = 0
    # json-schema: the schema the output must match (OpenAI's response_format).
    json_schema: dict | None = None
    # The model it names (a LoRA adapter: --lora-modules); empty: --model's.
    model: str = ""


@dataclass(slots=True)
class Conversation:
    """Turns of one chat: turn t's prompt is turn t-1's prompt + its reply + messages[t]."""

    system: list[int]
    messages: list[list[int]]
    output_len: int


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(_LOW_ID_MARGIN, vocab - _LOW_ID_MARGIN) for _ in range(n)]


def _words(ids: list[int]) -> str:
    # Short distinct words, about one token each in common BPE vocabularies.
    return " ".join(f"w{i % 997}" for i in ids)


def _prompt(ids: list[int], fmt: PromptFormat) -> str | list[int]:
    return ids if fmt is PromptFormat.TOKEN_IDS else _words(ids)


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """``mean`` or, with a ratio r > 0, uniform in [mean * (1 - r), mean * (1 + r)]."""
    if range_ratio <= 0:
        return mean
    return rng.randint(max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio)))


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    range_ratio: float = 0.0,
    fmt: PromptFormat = PromptFormat.TOKEN_IDS,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = random_ids(rng, _length(rng, input_len, range_ratio), vocab)
        out.append(BenchRequest(_prompt(ids, fmt), len(ids), _length(rng, output_len, range_ratio)))
    return out


def shared_prefix_requests(
    groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    fmt: PromptFormat = PromptFormat.TOKEN_IDS,
) -> list[BenchRequest]:
    """G groups x P prompts; a group's prompts share one long system prompt.

    Shuffled, so a group's prompts arrive spread over the run (as SGLang's
    generated-shared-prefix dataset does), not back to back.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        system = random_ids(rng, system_len, vocab)
        for _ in range(prompts_per_group):
            ids = system + random_ids(rng, question_len, vocab)
            out.append(BenchRequest(_prompt(ids, fmt), len(ids), output_len))
    rng.shuffle(out)
    return out


def bench_schema(index: int, rng: random.Random) -> dict:
    """A nested JSON schema, the ``index``-th of a run: an object with a
    bounded integer, number, enum and pattern, an array of 1-4 strings and a
    nested object. Every string and array is bounded, so the output ends well
    within a few hundred tokens whatever the model; the property names carry
    ``index``, so the schemas of one run are distinct grammars (each compiled
    once, then cached)."""
    states = rng.sample(["new", "open", "held", "closed", "moved", "lost"], 3)
    short = {"type": "string", "minLength": 1, "maxLength": rng.choice([12, 16, 24])}
    address = {
        "type": "object",
        "properties": {"city": short, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
        "required": ["city", "zip"],
        "additionalProperties": False,
    }
    props = {
        f"id_{index}": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": short,
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "status": {"enum": states},
        "tags": {"type": "array", "items": short, "minItems": 1, "maxItems": 4},
        "address": address,
        "active": {"type": "boolean"},
    }
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def json_schema_requests(
    n: int,
    input_len: int,
    output_len: int,
    vocab: int,
    seed: int,
    schemas: int,
    range_ratio: float = 0.0,
    fmt: PromptFormat = PromptFormat.TOKEN_IDS,
) -> list[BenchRequest]:
    """Random prompts, each asking for one of ``schemas`` JSON schemas in turn;
    ``output_len`` is each request's max_tokens (the grammar ends it sooner).
    Text prompts open with the schema itself, as an instruction (a model with
    real weights then writes an object, not whitespace, under the grammar)."""
    rng = random.Random(seed)
    pool = [bench_schema(i, rng) for i in range(schemas)]
    out = []
    for i in range(n):
        schema = pool[i % schemas]
        ids = random_ids(rng, _length(rng, input_len, range_ratio), vocab)
        if fmt is PromptFormat.TOKEN_IDS:
            out.append(BenchRequest(ids, len(ids), output_len, json_schema=schema))
            continue
        text = f"Reply with one JSON object matching this schema: {json.dumps(schema)}\n"
        text += _words(ids)
        out.append(BenchRequest(text, len(text.split()), output_len, json_schema=schema))
    return out


@dataclass(slots=True)
class MultiTurnSpec:
    users: int = 24
    turns: int = 5
    systems: int = 4
    system_tokens: int = 256
    min_user_tokens: int = 48
    max_user_tokens: int = 128
    output_tokens: int = 48


@dataclass(slots=True)
class MultiTurnWorkload:
    """Synthetic chat traffic: ``users`` conversations on ``systems`` shared system
    prompts (token ids, so nothing depends on a chat template).

    benchmarks/routing.py drives it through three routing policies; `pdserve
    bench serve --dataset multi-turn` through the load generator.
    """

    systems: list[list[int]]
    messages: list[list[list[int]]]  # [user][turn] -> the user's message ids
    output_tokens: int = 48

    @classmethod
    def make(cls, spec: MultiTurnSpec, vocab: int, seed: int) -> MultiTurnWorkload:
        rng = random.Random(seed)
        systems = [random_ids(rng, spec.system_tokens, vocab) for _ in range(spec.systems)]
        messages = [
            [
                random_ids(rng, rng.randint(spec.min_user_tokens, spec.max_user_tokens), vocab)
                for _ in range(spec.turns)
            ]
            for _ in range(spec.users)
        ]
        return cls(systems, messages, spec.output_tokens)

    def conversation(self, user: int) -> Conversation:
        return Conversation(
            list(self.systems[user % len(self.systems)]), self.messages[user], self.output_tokens
        )

    def first_turn(self, user: int) -> BenchRequest:
        c = self.conversation(user)
        ids = c.system + c.messages[0]
        return BenchRequest(ids, len(ids), c.output_len, conversation=user, turn=0)

    def first_turns(self) -> list[BenchRequest]:
        """One request per conversation (its first turn); later turns follow replies."""
        return [self.first_turn(user) for user in range(len(self.messages))]

    def next_turn(self, done: BenchRequest, reply: list[int]) -> BenchRequest | None:
        """The turn after ``done`` given its reply's token ids; None after the last."""
        c = self.conversation(done.conversation)
        t = done.turn + 1
        if t >= len(c.messages):
            return None
        ids = [*done.prompt, *reply, *c.messages[t]]
        return BenchRequest(ids, len(ids), c.output_len, conversation=done.conversation, turn=t)


def _jsonl_error(path: Path, line: int, why: str) -> ValueError:
    return ValueError(f"{path}:{line}: {why}")


def jsonl_requests(
    path: Path, default_output_len: int, n: int | None = None, seed: int = 0
) -> list[BenchRequest]:
    """One request per line: {"prompt": "text" | [ids], "output_len": N (optional)}.

    With ``n`` larger than the file, prompts repeat (in a seeded shuffle).
    """
    rows: list[BenchRequest] = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise _jsonl_error(path, i, f"not JSON ({e.msg})") from None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise _jsonl_error(path, i, 'needs "prompt": a string or a list of token ids')
        out_len = obj.get("output_len", obj.get("max_tokens", default_output_len))
        if not isinstance(out_len, int) or out_len < 1:
            raise _jsonl_error(path, i, '"output_len" must be a positive integer')
        size = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        rows.append(BenchRequest(prompt, size, out_len))
    if not rows:
        raise _jsonl_error(path, 0, "no prompts")
    if n is None or n == len(rows):
        return rows
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    while len(out) < n:
        batch = list(rows)
        rng.shuffle(batch)
        out += batch
    return out[:n]


@dataclass(slots=True)
class Dataset:
    """The requests to send; ``multi_turn`` set when replies make further turns."""

    kind: DatasetKind
    requests: list[BenchRequest]
    multi_turn: MultiTurnWorkload | None = None
    extra: dict = field(default_factory=dict)

    @property
    def total_requests(self) -> int:
        if self.multi_turn is None:
            return len(self.requests)
        return sum(len(m) for m in self.multi_turn.messages)


def assign_lora_modules(dataset: Dataset, names: Sequence[str]) -> None:
    """Request i names ``names[i % len(names)]`` (``--lora-modules``): every
    adapter equally often, and every stretch of the run mixes them all."""
    if dataset.multi_turn is not None:
        raise ValueError(
            "--lora-modules names one adapter per request; a multi-turn conversation's "
            "turns would change adapter (and lose their cached prefix) from turn to turn"
        )
    for i, req in enumerate(dataset.requests):
        req.model = names[i % len(names)]
