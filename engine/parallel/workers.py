"""Ranks 1..t-1 of a tensor-parallel engine: one process each.

Start-up: rank 0 (the engine's process) hosts a TCPStore on a free loopback
port and starts the others as ``python -m engine.parallel.follower`` (a
fresh interpreter: no multiprocessing re-import of the user's script, and
the configuration travels as JSON on stdin, not pickled); each connects, says so in the store, and all of
them build the process groups (engine/parallel/group.py) and their
ModelRunner at the same time; the runners' construction is collective (KV
block count agreed as the minimum, CUDA graphs captured in the same order).
A rank that dies during start-up is reported by rank 0 with its exit code
instead of a hang.

Serving: a follower loops on ``Handoff.recv`` and runs each plan (its
forward, its share of the logits) until rank 0 sends STOP, or rank 0's
connection closes (rank 0 died: the follower exits). Rank 0 sees a dead
follower as a failed collective; ``TPWorkers.dead`` names it.

On a CPU every process gets ``cores / t`` intra-op threads, so t ranks do not
oversubscribe the host.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device import resolve_device
from engine.parallel.group import TPGroup
from engine.parallel.handoff import Handoff, max_plan_words

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or could not start."""


class TPWorkers:
    """Rank 0's handle on the follower processes and the group they share."""

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        size = config.tensor_parallel_size
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs; this host shows "
                f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES decides which)"
            )
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(size))
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self._closed = False
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ)
        # The follower imports this very package, wherever it was imported from.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        setup = json.dumps({"config": config.to_json(), "eos_token_ids": sorted(eos_token_ids)})
        for rank in range(1, size):
            cmd = [sys.executable, "-m", "engine.parallel.follower"]
            cmd += [str(rank), str(size), str(self.store.port)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            proc.stdin.write(setup.encode())
            proc.stdin.close()
        try:
            self._wait_until_connected(size)
            self.group = TPGroup(0, size, device, self.store)
            self.group.handoff = Handoff(self.group, handoff_capacity(config), self._raise_if_dead)
        except BaseException:
            self.close()
            raise

    def _wait_until_connected(self, size: int) -> None:
        keys = [f"up/{rank}" for rank in range(1, size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.store.check(keys):
            dead = self.dead()
            if dead:
                raise TensorParallelError(f"tensor-parallel start-up failed: {dead}")
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel ranks did not connect within {START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)

    def _raise_if_dead(self) -> None:
        if dead := self.dead():
            raise TensorParallelError(f"a tensor-parallel rank died: {dead}")

    def dead(self) -> str:
        """'' while every follower lives; else which died and how."""
        gone = [
            f"rank {rank} (pid {p.pid}) exited with code {p.returncode}"
            for rank, p in enumerate(self.procs, start=1)
            if p.poll() is not None
        ]
        return "; ".join(gone)

    def close(self) -> None:
        """Stop the followers (STOP, then a join; killed after ``JOIN_TIMEOUT_S``)."""
        if self._closed:
            return
        self._closed = True
        group = getattr(self, "group", None)
        # With a rank gone the others cannot finish a collective: no STOP, no wait.
        broken = bool(self.dead())
        handoff = group.handoff if group is not None else None
        if handoff is not None and not broken:
            try:
                handoff.stop()
            except Exception as e:  # a follower gone: join and kill below
                logger.debug("tensor-parallel stop message not delivered: %s", e)
                broken = True
        for p in self.procs:
            try:
                p.wait(0 if broken else JOIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if handoff is not None:
            handoff.close()
        if group is not None:
            group.shutdown()


def handoff_capacity(config: EngineConfig) -> int:
    """Words the hand-off channel must hold: the largest step the scheduler can form."""
    blocks_per_seq = -(-config.max_model_len // config.kvcache_block_size)
    return max_plan_words(config.max_num_batched_tokens, config.max_num_seqs, blocks_per_seq)


def threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)
