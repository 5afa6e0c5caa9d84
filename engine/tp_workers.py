"""The processes of a tensor-parallel engine: rank 0's handle on ranks 1..t-1
(``TPWorkers``) and their entry point (``python -m engine.tp_workers RANK
SIZE PORT``, ``main``).

Start-up: rank 0 (the engine's process) hosts a TCPStore on a free loopback
port and starts the others as ``python -m engine.tp_workers`` (a fresh
interpreter: no multiprocessing re-import of the user's script, and the
configuration and EOS ids travel as one JSON object on stdin, not pickled);
each connects, says so in the store, and all of
them build the process groups (engine/parallel/group.py) and their
ModelRunner at the same time; the runners' construction is collective (KV
block count agreed as the minimum, CUDA graphs captured in the same order).
A rank that dies during start-up is reported by rank 0 with its exit code
instead of a hang.

Serving: a follower loops on ``Handoff.recv`` and runs each plan (its
forward, its share of the logits) until rank 0 sends STOP, or rank 0's
connection closes (rank 0 died: the follower exits). Rank 0 sees a dead
follower as a failed collective; ``TPWorkers.dead`` names it.

Worker extension (``worker_extension_cls``, vLLM's name): a class the
follower builds with its ModelRunner after start-up; rank 0's
``LLMEngine.call_workers(method, payload)`` reaches its methods, in order with
the steps (a call published before step N runs before step N). A node's KV
transfer runs on every rank this way, in code the engine does not import.

On a CPU every process gets ``cores / t`` intra-op threads, so t ranks do not
oversubscribe the host.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device import resolve_device
from engine.host_tier import TierPlan
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup
from engine.parallel.handoff import Call, Handoff, max_plan_words
from engine.parallel.shm_channel import ChannelClosed, parent_alive

logger = logging.getLogger("engine.tp_workers")

START_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 10.0
RANK_EXIT_WAIT_S = 10.0


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
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        setup = json.dumps({"config": config.to_json(), "eos_token_ids": sorted(eos_token_ids)})
        for rank in range(1, size):
            cmd = [sys.executable, "-m", "engine.tp_workers"]
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

    def raise_if_dead(self, error: Exception) -> None:
        """After a failed collective: if a rank died, say which (TensorParallelError)."""
        # Its exit code may lag its closed sockets by seconds on a loaded host (a
        # rank that fails tears its groups down, then the interpreter exits).
        deadline = time.monotonic() + RANK_EXIT_WAIT_S
        while not (dead := self.dead()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:
            self.close()
            raise TensorParallelError(
                f"a tensor-parallel rank died, the engine cannot go on: {dead}"
            ) from error

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


def load_worker_extension(name: str) -> type:
    """The class ``worker_extension_cls`` names ("module:Class" or "module.Class")."""
    module, sep, cls = name.partition(":")
    if not sep:
        module, _, cls = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls {name!r} cannot be loaded: {e}") from e


def threads_per_rank(size: int) -> int:
    """CPU threads of one rank: OMP_NUM_THREADS where it is set (per process
    already: `pdserve up` shares the host's cores out that way), else the
    host's cores shared by the ranks."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, (os.cpu_count() or 1) // size)


def main(argv: list[str]) -> int:
    """A follower rank: connect, build the ModelRunner (collectively with the
    other ranks), run each step rank 0 hands off until STOP or until rank 0 is
    gone. Ctrl-C is ignored here: the follower leaves when its rank 0 does."""
    rank, size, port = (int(a) for a in argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s"
    )
    setup = json.loads(sys.stdin.read())
    config = EngineConfig.from_json(setup["config"])
    eos_token_ids = frozenset(setup["eos_token_ids"])
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(threads_per_rank(size))
    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    store.set(f"up/{rank}", "1")
    group = TPGroup(rank, size, device, store)
    group.handoff = Handoff(group, handoff_capacity(config), parent_alive(os.getppid()))
    runner = ModelRunner(config, eos_token_ids, group)
    extension = None
    if config.worker_extension_cls:
        extension = load_worker_extension(config.worker_extension_cls)(runner)
    try:
        while (item := runner.handoff.recv()) is not None:
            if isinstance(item, Call):
                _run_call(extension, item)
            elif isinstance(item, TierPlan):
                runner.follow_tier(item)
            else:
                runner.follow(item)
    except ChannelClosed as e:
        # Rank 0 died without closing the channel: remove its file for it.
        logger.warning("leaving: %s", e)
        group.handoff.close(unlink=True)
        return 1
    except Exception as e:  # rank 0 broken, or this rank's own call failed
        logger.exception("leaving: %s", e)
        return 1
    finally:
        group.handoff.close()
        group.shutdown()
    return 0


def _run_call(extension, call: Call) -> None:
    """One call from rank 0. One that fails (or names no method of the
    extension) ends this rank: its state would no longer be what rank 0
    assumes, and a dead rank is what rank 0 reports (TensorParallelError)."""
    method = getattr(extension, call.method, None) if extension is not None else None
    if method is None or call.method.startswith("_"):
        raise RuntimeError(f"rank 0 called {call.method!r}, which this rank's extension lacks")
    method(json.loads(call.payload))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
