"""Loading a Hugging Face tokenizer from a local directory, with a clear error."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the model directory ``path``.

    A directory with a ``tokenizer.json`` (every fast tokenizer) loads it
    through ``PreTrainedTokenizerFast``: the same file, chat template and
    special tokens as ``AutoTokenizer``, without the auto classes' import of
    torch and of every model configuration, which is most of a router's start
    on a small host. Other directories (sentencepiece only) go through
    ``AutoTokenizer``."""
    # Imported here: transformers takes seconds to import and nodes started
    # with skip_tokenizer_init never need it.
    if (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader
    try:
        return loader.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"tokenizer: cannot load a tokenizer from {path!r} ({e}); pass tokenizer=DIR or "
            "skip_tokenizer_init=True with token-id prompts"
        ) from e
