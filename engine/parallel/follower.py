"""``python -m engine.parallel.follower RANK SIZE PORT``: one follower rank of a
tensor-parallel engine (engine/parallel/workers.py starts it; its engine's
configuration and EOS ids come as one JSON object on stdin).

It connects to rank 0's TCPStore, builds its ModelRunner (collectively with
the other ranks) and runs each step rank 0 hands off until STOP, or until
rank 0's connection closes. Ctrl-C is ignored here: the follower leaves when
its rank 0 does.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.device import resolve_device
from engine.model_runner import ModelRunner
from engine.parallel.group import TPGroup
from engine.parallel.handoff import Handoff
from engine.parallel.shm_channel import ChannelClosed, parent_alive
from engine.parallel.workers import START_TIMEOUT_S, handoff_capacity, threads_per_rank

logger = logging.getLogger("engine.parallel.follower")


def main(argv: list[str]) -> int:
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
    try:
        while (plan := runner.handoff.recv()) is not None:
            runner.follow(plan)
    except ChannelClosed as e:
        # Rank 0 died without closing the channel: remove its file for it.
        logger.warning("leaving: %s", e)
        group.handoff.close(unlink=True)
        return 1
    except Exception as e:  # rank 0 broken: nothing left to follow
        logger.warning("leaving: %s", e)
        return 1
    finally:
        group.handoff.close()
        group.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
