"""Ranks 1..t-1 of a tensor-parallel prefill node: each sends its own KV heads.

The engine builds ``PrefillRank`` in every rank's process but rank 0
(``worker_extension_cls``); rank 0's node code reaches it through
``LLMEngine.call_workers``, in order with the steps:

- ``setup`` (once, at start): this rank's KV sender (its own pair channels to
  the decode ranks it pairs with, common/kv_transfer/pairing.py) and streamer,
  installed as the rank's KV-write observer;
- ``kv_step``: the segments rank 0 planned for the next step; the streamer
  sends this rank's heads of them layer by layer as that step runs;
- ``kv_finish``: a Prefill is done: end headers to the decode ranks this rank
  sends to, after everything queued for it.

The rank's sending threads end with its process, when rank 0 stops it.

A failed send fails this rank's part only; the decode node sees its channel
fail or its reservation stay incomplete, frees the blocks and the request is
retried, as when rank 0's part fails.
"""

from __future__ import annotations

from common.kv_transfer.sender import KVSender
from common.kv_transfer.ticket import Destination
from common.runtime.reliability import FaultDelays
from prefill_node.kv_stream import KVStreamer, StepSegment


class PrefillRank:
    def __init__(self, runner) -> None:
        self.runner = runner
        self.sender: KVSender | None = None
        self.streamer: KVStreamer | None = None

    def setup(self, payload: dict) -> None:
        runner = self.runner
        self.sender = KVSender(
            payload["node_id"],
            runner.device,
            timeout_s=payload["timeout_s"],
            connect_timeout_s=payload["connect_timeout_s"],
            faults=FaultDelays.from_env(),
            rank=runner.tp.rank,
        )
        self.streamer = KVStreamer(
            runner.kv_cache,
            runner.block_size,
            self.sender,
            payload["layers_per_chunk"],
            num_kv_heads=runner.layout.num_kv_heads,
            last_layers=payload["last_layers"],
            tp_rank=runner.tp.rank,
            tp_size=runner.tp.size,
            kv_scales=runner.kv_scales,
        )
        runner.kv_observer = self.streamer

    def kv_step(self, payload: dict) -> None:
        self.streamer.follow_step([StepSegment.from_json(s) for s in payload["segments"]])

    def kv_finish(self, payload: dict) -> None:
        dest = Destination(**payload["dest"])
        self.streamer.follow_finish(payload["request_id"], dest, payload["reservation_id"])
