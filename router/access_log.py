"""The router's access log: one INFO line per request that ended (`--no-access-log`
turns it off), so that a serving cluster's log says what it serves:

    request 3f2a...: OK prompt 24 (cached 16) completion 12 tokens, TTFT 85 ms,
    total 402 ms, prefill prefill-0, decode decode-0
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

    def line(self) -> str:
        ttft = f"{self.ttft_ms:.0f} ms" if self.ttft_ms is not None else "-"
        if self.decode_node:
            nodes = f"prefill {self.prefill_node or 'local'}, decode {self.decode_node}"
        else:
            nodes = "not routed"
        return (
            f"request {self.request_id}: {self.status} prompt {self.prompt_tokens} "
            f"(cached {self.cached_tokens}) completion {self.completion_tokens} tokens, "
            f"TTFT {ttft}, total {self.total_ms:.0f} ms, {nodes}"
        )


def log_access(entry: AccessEntry) -> None:
    logger.info("%s", entry.line())
