"""Prompt lookup: propose the tokens that followed the latest earlier occurrence
of the sequence's own suffix (vLLM's "ngram" method).

Host work over the prompt and output tokens, no model. The longest suffix
from ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens that occurs
earlier wins; among its occurrences the latest, whose continuation is the
likeliest to repeat in text being rewritten or edited.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.lookup_min = prompt_lookup_min
        self.lookup_max = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``token_ids`` (none when no suffix recurs)."""
        num = len(token_ids)
        if k <= 0 or num <= self.lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.lookup_max, num - 1), self.lookup_min - 1, -1):
            suffix = tokens[num - n :]
            # Windows that start before the suffix itself and leave at least
            # one token after them to propose.
            windows = sliding_window_view(tokens[: num - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
