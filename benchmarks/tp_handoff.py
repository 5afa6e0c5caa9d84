"""What tensor parallelism's per-step hand-off costs rank 0's host (CPU, gloo).

    python benchmarks/tp_handoff.py [--sizes 2 4 8] [--batches 1 64 256] [--steps 500]

Each step rank 0 encodes the step's plan (engine/parallel/handoff.py: host
inputs and logits rows as int64 words) and publishes it to the other ranks in
shared memory (engine/parallel/shm_channel.py); ``--transport gloo`` times
the first design instead, two broadcasts (header, payload) on the gloo
control group. This runs the real
Handoff between real processes (ranks 1..t-1 spawned, each receiving and
decoding every plan) with no model behind it, for decode steps of B
sequences at a 512-token context (block size 16) and for one 2048-token
prefill chunk, with a 2 ms pause between steps so each send is timed alone
(a step's forward runs between two sends in the engine). Reported: encode
and send time per step on rank 0, p50 and p90, in microseconds. A JSON
record goes to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from benchmarks.common import save_run
from engine.parallel.group import TPGroup
from engine.parallel.handoff import (
    HEADER_WORDS,
    Handoff,
    Logits,
    StepPlan,
    decode,
    encode,
    max_plan_words,
)
from engine.step_inputs import host_inputs

BLOCK = 16
CONTEXT = 512
TIMEOUT = datetime.timedelta(seconds=120)
# The engine's default limits (8192 batched tokens, 256 sequences, 4096-token context).
CAPACITY = max_plan_words(8192, 256, 4096 // BLOCK)


class GlooHandoff:
    """The first design, for comparison: the header, then the payload, each a
    broadcast on the gloo control group."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self._header = torch.zeros(HEADER_WORDS, dtype=torch.int64)

    def send(self, plan: StepPlan) -> None:
        header, payload = encode(plan)
        self.group.control_broadcast(torch.from_numpy(header))
        self.group.control_broadcast(torch.from_numpy(payload))

    def stop(self) -> None:
        self.group.control_broadcast(torch.zeros(HEADER_WORDS, dtype=torch.int64))

    def recv(self) -> StepPlan | None:
        self.group.control_broadcast(self._header)
        header = self._header.numpy().copy()
        if header[0] == 0:
            return None
        payload = torch.empty(int(header[-1]), dtype=torch.int64)
        self.group.control_broadcast(payload)
        return decode(header, payload.numpy())

    def close(self) -> None:
        pass


def make_handoff(transport: str, group: TPGroup):
    return Handoff(group, CAPACITY) if transport == "shm" else GlooHandoff(group)


def follower(rank: int, size: int, port: int, transport: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)
    group = TPGroup(rank, size, torch.device("cpu"), store)
    handoff = make_handoff(transport, group)
    while handoff.recv() is not None:
        pass
    handoff.close()
    group.shutdown()


def decode_plan(batch: int) -> StepPlan:
    blocks = CONTEXT // BLOCK
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    tokens = [[1] * CONTEXT for _ in range(batch)]
    host = host_inputs(tokens, [CONTEXT - 1] * batch, [1] * batch, tables, BLOCK)
    return StepPlan(host, patched=True, logits=Logits.ALL)


def prefill_plan(tokens: int) -> StepPlan:
    table = list(range(tokens // BLOCK))
    host = host_inputs([[1] * tokens], [0], [tokens], [table], BLOCK)
    return StepPlan(host, logits=Logits.ROWS, logit_rows=host.query_start_loc[1:] - 1)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def measure(size: int, plans: dict[str, StepPlan], steps: int, transport: str) -> dict[str, dict]:
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=follower, args=(r, size, store.port, transport)) for r in range(1, size)
    ]
    for p in procs:
        p.start()
    group = TPGroup(0, size, torch.device("cpu"), store)
    handoff = make_handoff(transport, group)
    out = {}
    for name, plan in plans.items():
        for _ in range(20):  # warm-up
            handoff.send(plan)
        enc, send = [], []
        for _ in range(steps):
            time.sleep(0.002)
            t0 = time.perf_counter()
            encode(plan)
            t1 = time.perf_counter()
            handoff.send(plan)
            t2 = time.perf_counter()
            enc.append((t1 - t0) * 1e6)
            send.append((t2 - t1) * 1e6)  # send: its own encode + the transport
        words = sum(len(a) for a in encode(plan))
        out[name] = {
            "payload_bytes": 8 * words,
            "encode_us": {"p50": statistics.median(enc), "p90": pct(enc, 90)},
            "send_us": {"p50": statistics.median(send), "p90": pct(send, 90)},
        }
        print(
            f"{transport} tp={size} {name:>12}: {8 * words:>8} B  encode p50 {out[name]['encode_us']['p50']:7.1f} us"
            f"  encode+send p50 {out[name]['send_us']['p50']:7.1f} us"
            f"  p90 {out[name]['send_us']['p90']:7.1f} us"
        )
    handoff.stop()
    for p in procs:
        p.join(30)
    handoff.close()
    group.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--transport", nargs="+", choices=["shm", "gloo"], default=["shm", "gloo"])
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    plans = {f"decode-{b}": decode_plan(b) for b in args.batches}
    plans[f"prefill-{args.prefill_tokens}"] = prefill_plan(args.prefill_tokens)
    results = {
        transport: {str(size): measure(size, plans, args.steps, transport) for size in args.sizes}
        for transport in args.transport
    }
    save_run("tp_handoff", args, results, argv)


if __name__ == "__main__":
    main()
