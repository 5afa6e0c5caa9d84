"""The context length the router serves: the one its nodes registered.

Every node publishes the ``max_model_len`` its engine serves with its
heartbeat (``NodeInfo.max_model_len``), and every routing read returns every
live node, so the router learns it on each request at no cost. The router
checks requests against it (router/frontend.py) and ``/v1/models`` shows it:
the router's refusals, the nodes' and the API agree by construction, whatever
flags each process was given.

- All nodes of a model are meant to agree. Where they do not (a rolling change
  of ``--max-model-len``), the router takes the smallest, so that whatever it
  accepts any node serves, and logs a warning naming the lengths until they
  agree again.
- Before any node registered (or while only nodes of a release that does not
  publish the field are up) it takes its own: ``--max-model-len``, else the
  model's. Requests then find no node to serve them anyway (UNAVAILABLE).
- The router's own length also caps the nodes' (a router's ``--max-model-len``
  may lower what it accepts, never raise it).
- When every node is gone it keeps the last length it learnt.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.cluster.state import NodeInfo

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedLength:
    own: int  # the router's: --max-model-len, else the model's config
    model_id: str
    nodes: int | None = None  # the smallest the live nodes registered; None before any
    _disagreement: frozenset[int] = field(default_factory=frozenset)

    @property
    def max_model_len(self) -> int:
        return self.own if self.nodes is None else min(self.nodes, self.own)

    def observe(self, nodes: Iterable[NodeInfo]) -> None:
        """Learn from one read of the live nodes (a routing view)."""
        lengths = {n.max_model_len for n in nodes if n.model_id == self.model_id}
        lengths.discard(0)  # a node of a release that does not publish it
        if not lengths:
            return
        before = self.max_model_len
        self.nodes = min(lengths)
        if len(lengths) > 1 and lengths != self._disagreement:
            logger.warning(
                "the nodes of %s serve different max_model_len: %s; accepting at most %d "
                "(the smallest) until they agree",
                self.model_id,
                sorted(lengths),
                self.max_model_len,
            )
        self._disagreement = frozenset(lengths) if len(lengths) > 1 else frozenset()
        if self.max_model_len != before:
            logger.info("serving max_model_len %d, the nodes' (was %d)", self.max_model_len, before)
