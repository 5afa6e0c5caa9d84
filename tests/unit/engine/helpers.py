"""Small builders shared by the torch-free unit tests."""

from __future__ import annotations

import itertools

from engine.block_hash import BlockHasher
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

_ids = itertools.count()


def make_seq(
    prompt: list[int] | int,
    block_size: int = 4,
    hashed: bool = True,
    params: SamplingParams | None = None,
    request_id: str | None = None,
) -> Sequence:
    seq_id = next(_ids)
    # An int asks for that many tokens, distinct per sequence (no accidental prefix hits).
    base = 1000 * (seq_id + 1)
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(
        seq_id=seq_id,
        request_id=request_id or f"r{seq_id}",
        index=0,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        params=params or SamplingParams(),
        hasher=BlockHasher("test-model", block_size) if hashed else None,
    )
