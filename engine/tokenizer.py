"""Loading a Hugging Face tokenizer from a local directory, with a clear error."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    # Imported here: transformers takes seconds to import and nodes started
    # with skip_tokenizer_init never need it.
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"tokenizer: cannot load a tokenizer from {path!r} ({e}); pass tokenizer=DIR or "
            "skip_tokenizer_init=True with token-id prompts"
        ) from e
