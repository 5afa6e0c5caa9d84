"""The router's access log: one INFO line per request that ended (`--no-access-log`
turns it off), so that a serving cluster's log says what it serves:

    request 3f2a...: OK prompt 24 (cached 16) completion 12 tokens, TTFT 85 ms,
    total 402 ms, prefill prefill-0 (71 ms there), decode decode-0
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("pdserve.access")


@dataclass(slots=True)
class AccessEntry:
    request_id: str
    status: str  # a gRPC status code name
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float | None  # None: no token came
    total_ms: float
    prefill_node: str  # "" : prefilled on the decode node (or never routed)
    decode_node: str
    # The prefill node's own time for it (its reply's, where it came before the
    # stream ended; 0 otherwise, or without a prefill node).
    prefill_ms: float = 0.0

    def attributes(self, attempts: int, migrations: int) -> dict:
        """The same figures as span attributes (common/tracing.py)."""
        return {
            "pdserve.request_id": self.request_id,
            "pdserve.status": self.status,
            "pdserve.prompt_tokens": self.prompt_tokens,
            "pdserve.cached_tokens": self.cached_tokens,
            "pdserve.completion_tokens": self.completion_tokens,
            "pdserve.ttft_ms": self.ttft_ms,
            "pdserve.prefill_node": self.prefill_node or None,
            "pdserve.decode_node": self.decode_node or None,
            "pdserve.prefill_node_ms": self.prefill_ms or None,
            "pdserve.attempts": attempts,
            "pdserve.migrations": migrations,
        }

    def line(self) -> str:
        ttft = f"{self.ttft_ms:.0f} ms" if self.ttft_ms is not None else "-"
        prefill = f" ({self.prefill_ms:.0f} ms there)" if self.prefill_ms else ""
        if self.decode_node:
            nodes = f"prefill {self.prefill_node or 'local'}{prefill}, decode {self.decode_node}"
        else:
            nodes = "not routed"
        return (
            f"request {self.request_id}: {self.status} prompt {self.prompt_tokens} "
            f"(cached {self.cached_tokens}) completion {self.completion_tokens} tokens, "
            f"TTFT {ttft}, total {self.total_ms:.0f} ms, {nodes}"
        )


def log_access(entry: AccessEntry) -> None:
    logger.info("%s", entry.line())
