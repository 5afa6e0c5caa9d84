"""The process groups of one tensor-parallel engine.

Two groups over the same ranks, built on a TCPStore that rank 0 hosts:

- ``device``: the model's collectives (all-reduce after the row-parallel
  projections, all-gather of the vocabulary-parallel logits, the broadcast of
  async-scheduled input ids): NCCL on CUDA, gloo on a CPU;
- ``control``: gloo on host tensors, always: start-up agreements (the KV
  block count). The per-step hand-off goes through shared memory instead
  (engine/parallel/handoff.py, ``handoff``), set on the group by whoever
  started the rank.

The groups are built as ProcessGroup objects, not through
``init_process_group``: the default group is process-wide state, and a node
process also builds its own KV-transfer groups.

With one rank (``TPGroup.single``) every collective is a no-op, so the model
code calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

# Rank 0 may wait hours between steps (an idle server); a worker's wait for the
# next step must not time out. A dead peer is seen at once (its connection closes).
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TPGroup:
    def __init__(
        self,
        rank: int,
        size: int,
        device: torch.device,
        store: dist.Store | None = None,
        timeout: datetime.timedelta = IDLE_TIMEOUT,
    ) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.store = store
        self._device_pg = None
        self._control_pg = None
        # How rank 0 hands each step to the others (engine/parallel/handoff.py);
        # set by whoever started this rank, before its ModelRunner is built.
        self.handoff = None
        if size == 1:
            return
        if store is None:
            raise ValueError("a tensor-parallel group of several ranks needs a store")
        self._control_pg = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, size, timeout
        )
        device_store = dist.PrefixStore("device", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._device_pg = dist.ProcessGroupNCCL(device_store, rank, size, opts)
        else:
            self._device_pg = dist.ProcessGroupGloo(device_store, rank, size, timeout)

    @classmethod
    def single(cls, device: torch.device) -> TPGroup:
        return cls(0, 1, device)

    @property
    def is_driver(self) -> bool:
        """Rank 0: it runs the scheduler and samples; the others follow its steps."""
        return self.rank == 0

    # ------------------------------------------------------ the model's collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (returns it)."""
        if self._device_pg is not None:
            self._device_pg.allreduce([t]).wait()
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` side by side along the last dimension (rank order)."""
        if self._device_pg is None:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._device_pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank, in place, on the device group."""
        if self._device_pg is not None:
            self._device_pg.broadcast([t], _root0(dist.BroadcastOptions)).wait()
        return t

    # ------------------------------------------------------------- host control
    def control_broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's host tensor ``t`` on every rank, in place (gloo)."""
        if self._control_pg is not None:
            self._control_pg.broadcast([t], _root0(dist.BroadcastOptions)).wait()
        return t

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (every rank gets it)."""
        if self._control_pg is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._control_pg.allreduce([t], opts).wait()
        return int(t.item())

    def shutdown(self) -> None:
        for pg in (self._device_pg, self._control_pg):
            if pg is not None and hasattr(pg, "shutdown"):
                # A group already broken (a peer gone) has nothing left to release.
                with contextlib.suppress(Exception):
                    pg.shutdown()
        self._device_pg = self._control_pg = None


def _root0(options_cls):
    opts = options_cls()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts
