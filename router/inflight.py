"""What this router has in flight on each node, and which nodes just failed it.

Heartbeats are up to one interval old, and a node may report wrongly (a bug,
a restart, a lie). The router therefore counts what it sent each node itself:
the policy adds what it sent since the node's last report to that report, and
never believes a report below its own count (router/policy.py). Several
routers share nothing else: each keeps its own share even, and sees the
others' only through the nodes' reports. A burst sent through several routers
at once can therefore lean: when one node's report already shows another
router's latest requests and its peer's does not yet, every router favours
the same node until the next heartbeat, and a burst splits unevenly
(docs/lab/2026-11-21-routing-workload-and-decision.md has the splits measured).
Counting every router's in-flight requests in Redis would remove that; not
done.

Times are this process's monotonic clock; a report's time is placed on it from
its age on the Redis server's clock (ClusterView.age_ms), so host clock skew
does not matter.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from common.cluster.state import ClusterView
from router.policy import LocalLoad


@dataclass(slots=True)
class Dispatch:
    """One request on its way through one decode node (and maybe a prefill node)."""

    ticket: int
    decode_id: str
    prefill_id: str | None
    prefill_tokens: int  # uncached prompt tokens the prefill work covers
    blocks: int  # KV blocks it takes on the decode node
    sent_at: float
    prefill_done: bool = False


class InflightTracker:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._tickets = itertools.count()
        self._dispatches: dict[int, Dispatch] = {}
        self._failed_at: dict[str, float] = {}

    def start(
        self, decode_id: str, prefill_id: str | None, prefill_tokens: int, blocks: int
    ) -> Dispatch:
        d = Dispatch(
            next(self._tickets), decode_id, prefill_id, prefill_tokens, blocks, self._clock()
        )
        self._dispatches[d.ticket] = d
        return d

    def first_token(self, d: Dispatch) -> None:
        """The prompt is prefilled: it no longer weighs on a prefill queue."""
        d.prefill_done = True

    def finish(self, d: Dispatch) -> None:
        self._dispatches.pop(d.ticket, None)

    def failed(self, node_id: str) -> None:
        """A call to this node failed (unreachable, reset): avoid it for a while."""
        self._failed_at[node_id] = self._clock()

    def succeeded(self, node_id: str) -> None:
        self._failed_at.pop(node_id, None)

    @property
    def in_flight(self) -> int:
        return len(self._dispatches)

    def loads(self, view: ClusterView) -> dict[str, LocalLoad]:
        """Per node: what this router has there, split at the node's last report."""
        if not self._dispatches and not self._failed_at:
            return {}  # nothing sent, nothing failed: the common case at low load
        now = self._clock()
        reported_at = {c.node.node_id: now - view.age_ms(c.node) / 1e3 for c in view.candidates}
        out: dict[str, LocalLoad] = {}
        for d in self._dispatches.values():
            dec = out.setdefault(d.decode_id, LocalLoad())
            after = d.sent_at > reported_at.get(d.decode_id, float("-inf"))
            dec.requests += 1
            dec.blocks += d.blocks
            if after:
                dec.requests_since_report += 1
                dec.blocks_since_report += d.blocks
            prefill_id = d.prefill_id or d.decode_id
            if not d.prefill_done:
                pre = out.setdefault(prefill_id, LocalLoad())
                pre.prefill_tokens += d.prefill_tokens
                if d.sent_at > reported_at.get(prefill_id, float("-inf")):
                    pre.prefill_tokens_since_report += d.prefill_tokens
        for node_id, at in list(self._failed_at.items()):
            if now - at > 3600:  # forget ancient failures
                del self._failed_at[node_id]
                continue
            out.setdefault(node_id, LocalLoad()).failed_ago_s = now - at
        return out
