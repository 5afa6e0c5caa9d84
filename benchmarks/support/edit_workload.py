"""An input-grounded workload for prompt lookup: correct the spelling of a given
text (benchmarks/spec_decode.py, part ``ngram``).

The texts are prose paragraphs of this repository's own docs (real English,
no data set to carry), with seeded typos (two adjacent letters of a word
swapped) for the model to correct: the answer is mostly a copy of the
prompt, which is where n-gram prompt lookup pays. The docs change with the
tree, so the record names the prompts' digest beside pdserve's revision.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
INSTRUCTION = (
    "Correct the spelling mistakes in the following text. Reply with the corrected "
    "text only, otherwise unchanged.\n\n"
)
MIN_CHARS, MAX_CHARS = 300, 1200
TYPO_RATE = 0.08  # of the words of 4 letters or more
ANSWER_SLACK = 32  # tokens allowed beyond the text's own length


@dataclass(slots=True)
class EditRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def paragraphs(docs_dir: Path = DOCS_DIR) -> list[str]:
    """The docs' prose paragraphs (no headings, lists, tables or code), one line each."""
    found = []
    for path in sorted(docs_dir.glob("*.md")):
        for block in path.read_text().split("\n\n"):
            text = " ".join(block.split())
            if (
                MIN_CHARS <= len(text) <= MAX_CHARS
                and text[0].isalpha()
                and "|" not in text
                and "```" not in text
            ):
                found.append(text)
    return found


def with_typos(text: str, rng: random.Random) -> str:
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 4 and word.isalpha() and rng.random() < TYPO_RATE:
            j = rng.randrange(1, len(word) - 2)  # the first and last letters stay
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def edit_requests(tokenizer: Any, num: int, seed: int) -> list[EditRequest]:
    """``num`` requests (paragraphs drawn without repeats while they last)."""
    pool = paragraphs()
    if not pool:
        raise RuntimeError(f"no prose paragraphs found under {DOCS_DIR}")
    rng = random.Random(seed)
    order = rng.sample(pool, len(pool))
    requests = []
    for i in range(num):
        text = order[i % len(order)]
        content = INSTRUCTION + with_typos(text, rng)
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        # The template holds any BOS/special tokens already (as LLM.chat does).
        ids = tokenizer.encode(chat, add_special_tokens=False)
        answer_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(EditRequest(ids, answer_len + ANSWER_SLACK))
    return requests


def digest(requests: list[EditRequest]) -> str:
    """Names the workload in a record: equal digests, equal prompts and lengths."""
    h = hashlib.sha256()
    for r in requests:
        h.update(repr((r.prompt_token_ids, r.max_tokens)).encode())
    return h.hexdigest()[:16]
