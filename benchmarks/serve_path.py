"""Where a request's first token goes on the serving path: the engine alone, the
decode node over gRPC, and the router in front, on the same engine config.

    python benchmarks/serve_path.py --torch-threads 1 --out benchmarks/results   # CPU, tiny shape
    python benchmarks/serve_path.py --shape llama-3.1-8b --groups 8 --prompts-per-group 32 \\
        --system-len 2048 --question-len 128 --output-len 128 --request-rate 8 16 \\
        --num-prompts 96 --warmup-rounds 1 --engine-args '--num-kvcache-blocks 8192' --out $OUT

(On a GPU both engines share it: a fixed --num-kvcache-blocks keeps either from
sizing its KV cache from what the other left free.)

The same shared-prefix workload (``pdserve bench serve``'s dataset: G groups x P
prompts sharing a system prompt, ignore_eos) at a Poisson rate, three ways,
interleaved round by round (engine, node, router, engine, ...):

- engine: the engine on its EngineThread in this process, requests added from
  an asyncio loop (as benchmarks/online_ttft.py does);
- node: one decode node process (local prefill) called directly over gRPC;
- router: the same node behind a `pdserve router` process (--no-remote-prefill).
- engine-early: the engine mode's engine with late launch switched off for the
  sweep (engine/step_clock.py; the clock keeps counting): an A/B on one engine.
  Both engine modes report the clock's launches, held launches and launches
  the device had to wait for.

``--dataset random``: ``--num-prompts`` prompts of ``--input-len`` random ids
and no warm-up; the engine modes of a round get the same prompts and arrivals
(the prefix cache emptied before each), the node and router modes their own.

Both engines take the same flags (``--engine-args`` goes to both). The node
is benchmarks/serve_path_node.py's: the real decode node with a timestamp at
each hop, so a first token splits into to_node (client send to the Decode
handler starting), prepare (to the worker handing the request to the engine
thread), handoff (to the engine thread adding it), queued (to first
scheduled), computed (to the first token read on the host), to_loop (the rest
of that engine step, until the output is handed to the loop), loop (the loop
picking it up and building the message) and to_client (to the client reading
it); their means add up to the TTFT's mean. Besides: write (how long gRPC took
to report that message written), and the serving path's two spans, way_in
(send to added) and way_out (first token read to the client). Every process
is on one host, so ``time.monotonic()`` is one clock. Per sweep also: the CPU
time per streamed token of the node's loop thread, its engine thread, the
node and the router processes, how long those two threads waited for a CPU
(from /proc), and a GIL probe's lag (a thread in the node, and one in this
process for the engine mode, sleeping 2 ms at a time: how late it wakes,
p50/p90 in us), i.e. how long a thread that wakes up waits for the GIL. Each
sweep first warms every group's system prompt into the prefix cache (not
counted). A JSON record goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import command_line, environment, write_record
from benchmarks.serve_path_figures import lag_summary, line, summarize, summarize_rounds
from benchmarks.serve_path_node import TAIL, Cluster, GilProbe, cpu_seconds, runq_seconds
from engine.models.shapes import SHAPES, write_shape_dir
from pdserve.bench.datasets import random_requests, shared_prefix_requests

# engine-early: the engine mode's engine with late launch off (engine/step_clock.py),
# for an A/B on one engine, round by round.
MODES = ("engine", "engine-early", "node", "router")
ENGINE_MODES = ("engine", "engine-early")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--request-rate", type=float, nargs="+", default=[8.0])
    p.add_argument("--num-prompts", type=int, default=64, help="per sweep")
    p.add_argument("--rounds", type=int, default=2, help="sweeps of each mode and rate")
    p.add_argument("--warmup-rounds", type=int, default=0, help="rounds first, not summarized")
    p.add_argument(
        "--dataset",
        choices=["shared-prefix", "random"],
        default="shared-prefix",
        help="random: --num-prompts prompts of --input-len random ids, no warm-up",
    )
    p.add_argument("--input-len", type=int, default=1024, help="random dataset only")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--async-scheduling", choices=["on", "off"], default="on")
    p.add_argument("--engine-args", default="", help="more engine flags for both engines")
    p.add_argument("--torch-threads", type=int, default=0, help="torch's CPU threads (0: as is)")
    p.add_argument("--switch-interval-ms", type=float, help="GIL switch interval, node and here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, help="directory for the JSON record and the logs")
    return p.parse_args(argv)


# ------------------------------------------------------------------ clients
async def via_engine(thread, rid: str, prompt: list[int], output_len: int, rec) -> None:
    from engine.request_stream import RequestStream
    from engine.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    stream = RequestStream()

    def sink(out) -> None:  # on the engine thread, as the node's traced sink
        if "sink" not in rec and any(c.token_ids for c in getattr(out, "outputs", ())):
            rec["sink"] = time.monotonic()
            rec["scheduled"] = out.metrics.first_scheduled_time
            rec["first_token"] = out.metrics.first_token_time
        stream.sink(out)

    def add(engine) -> None:
        rec["added"] = time.monotonic()
        engine.add_request(rid, prompt, params, arrival_time=rec["added"])

    rec["sent"] = rec["received"] = rec["submitted"] = time.monotonic()  # the loop is the node's
    await asyncio.wrap_future(thread.add(rid, sink, add))
    async for out in stream:
        new = sum(len(c.token_ids) for c in out.outputs)
        if new and "first" not in rec:
            rec["first"] = rec["yielded"] = time.monotonic()
        rec["tokens"] = rec.get("tokens", 0) + new
    rec["end"] = time.monotonic()


async def via_grpc(call, rec) -> None:
    rec["sent"] = time.monotonic()
    async for response in call:
        new = sum(len(d.token_ids) for d in response.deltas)
        if new and "first" not in rec:
            rec["first"] = time.monotonic()
        rec["tokens"] = rec.get("tokens", 0) + new
    rec["end"] = time.monotonic()


class Target:
    """One way in: ``start(rid, prompt, rec)`` returns the request's coroutine."""

    def __init__(self, mode: str, output_len: int, thread=None, address: str = "") -> None:
        self.mode, self.output_len, self.thread = mode, output_len, thread
        self.channel = None
        if address:
            import grpc

            self.channel = grpc.aio.insecure_channel(address)

    def start(self, rid: str, prompt: list[int], rec: dict[str, float]):
        if self.mode in ENGINE_MODES:
            return via_engine(self.thread, rid, prompt, self.output_len, rec)
        from proto import internal_pb2, internal_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc

        sampling = pdserve_pb2.SamplingParams(max_tokens=self.output_len, ignore_eos=True)
        if self.mode == "node":
            stub = internal_pb2_grpc.DecodeNodeStub(self.channel)
            req = internal_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling
            )
            return via_grpc(stub.Decode(req, timeout=120), rec)
        stub = pdserve_pb2_grpc.RouterStub(self.channel)
        req = pdserve_pb2.GenerateRequest(
            request_id=rid, token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling
        )
        return via_grpc(stub.Generate(req, timeout=120), rec)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


async def sweep(target: Target, prompts: list[list[int]], rate: float, seed: int, tag: str):
    rng = random.Random(seed)
    records: list[dict[str, Any]] = [{"tail": p[-TAIL:]} for p in prompts]
    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(target.start(f"{tag}-{i}", prompt, records[i])))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return records


def workload(args, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """Sweep k's prompts, and one warm-up prompt per group (its system prompt
    and a question no measured prompt has); the random dataset has none."""
    vocab = SHAPES[args.shape]["vocab_size"]
    if args.dataset == "random":
        reqs = random_requests(
            args.num_prompts, args.input_len, args.output_len, vocab, args.seed + 1000 * k
        )
        return [list(r.prompt) for r in reqs], []  # k: the round and rate (see one_sweep)
    reqs = shared_prefix_requests(
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        args.output_len,
        vocab,
        args.seed + 1000 * k,
    )[: args.num_prompts]
    prompts = [list(r.prompt) for r in reqs]
    systems = {tuple(p[: args.system_len]) for p in prompts}
    warm = [
        list(s) + [(i * 7919 + j) % vocab for j in range(args.question_len)]
        for i, s in enumerate(systems)
    ]
    return prompts, warm


def engine_flags(args) -> list[str]:
    """The node's engine flags; the engine mode parses the same ones (one config)."""
    flags = ["--load-format", "dummy", "--skip-tokenizer-init", "--seed", str(args.seed)]
    flags += ["--max-model-len", str(args.max_model_len)]
    flags += ["--async-scheduling" if args.async_scheduling == "on" else "--no-async-scheduling"]
    if args.device != "auto":
        flags += ["--device", args.device]
    return flags + shlex.split(args.engine_args)


def engine_kwargs_of(flags: list[str]) -> dict[str, Any]:
    from common.runtime.config import add_engine_flags, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    return engine_kwargs(parser.parse_args(flags))


# ------------------------------------------------------------------ the run
class LateLaunchWindow:
    """Late launch on or off for one engine-mode sweep (the engine's step clock
    keeps learning and counting either way), and its counts over the sweep."""

    NAMES = ("num_launches", "num_late_launches", "num_idle_launches")

    def __init__(self, engine, late: bool) -> None:
        self.clock = getattr(engine, "step_clock", None) if engine is not None else None
        if self.clock is not None:
            self.clock.enabled = late
            self.start = {n: getattr(self.clock, n) for n in self.NAMES}

    def counts(self) -> dict[str, int] | None:
        if self.clock is None:
            return None  # no clock: late launch is off in the config, or no CUDA
        return {n: getattr(self.clock, n) - self.start[n] for n in self.NAMES}


async def one_sweep(
    args, mode: str, targets, cluster, thread, local_lags, k: int, rnd: int, rate: float
):
    """Sweep k: warm its groups, send its prompts at ``rate``, join the node's timestamps."""
    if args.dataset == "random" and mode in ENGINE_MODES:
        # The engine modes of a round get the same prompts and arrivals (a
        # paired A/B), the engine forgetting the last mode's prompts first;
        # the node and router modes get prompts of their own, never cached.
        k = -1 - (rnd * len(args.request_rate) + args.request_rate.index(rate))
        await asyncio.wrap_future(targets[mode].thread.call(lambda e: e.reset_prefix_cache()))
    prompts, warm = workload(args, k)
    if warm:
        await sweep(targets[mode], warm, float("inf"), args.seed, f"w{k}")
    engine = targets[mode].thread.engine if mode in ENGINE_MODES else None
    clock = LateLaunchWindow(engine, mode == "engine")
    if mode in ENGINE_MODES:
        pid = os.getpid()
        threads = {"loop": (pid, threading.get_native_id()), "engine": (pid, thread.native_id)}
    else:
        threads = cluster.threads()
    cpu0 = {name: cpu_seconds(*ids) for name, ids in threads.items()}
    runq0 = {name: runq_seconds(*ids) for name, ids in threads.items() if ids[1]}
    start = time.monotonic()
    records = await sweep(targets[mode], prompts, rate, args.seed + k, f"s{k}-{mode}")
    end = time.monotonic()
    tokens = max(1, sum(r.get("tokens", 0) for r in records))
    cpu = {name: (cpu_seconds(*ids) - cpu0[name]) * 1e6 / tokens for name, ids in threads.items()}
    runq = {name: (runq_seconds(*threads[name]) - t) * 1e6 / tokens for name, t in runq0.items()}
    await asyncio.sleep(
        1.2
    )  # the node writes a stream's trace as it ends, its GIL lags each second
    if mode in ENGINE_MODES:
        lags = [x for t, second in local_lags if start + 1 <= t <= end + 1 for x in second]
    else:
        lags = cluster.gil_lags(start + 1, end + 1)
        traced = cluster.node_records()
        for r in records:
            r.update(traced.get(tuple(r["tail"]), {}))
    return {
        "mode": mode,
        "request_rate": rate,
        **summarize(records),
        "cpu_us_per_token": cpu,
        "runq_wait_us_per_token": runq,
        "gil_lag_us": lag_summary(lags),
        **({"late_launch": clock.counts()} if mode in ENGINE_MODES else {}),
    }


async def run(args, model_dir: Path, logs: Path) -> list[dict[str, Any]]:
    from engine import LLM
    from engine.engine_thread import EngineThread

    flags, thread, cluster = engine_flags(args), None, None
    local_lags: list[tuple[float, list[float]]] = []  # the engine mode's GIL probe
    targets: dict[str, Target] = {}
    try:
        if {"node", "router"} & set(args.modes):  # starts while this process loads its engine
            env = {"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else {}
            if args.switch_interval_ms is not None:
                env["SERVE_PATH_SWITCH_INTERVAL_MS"] = str(args.switch_interval_ms)
            cluster = Cluster(model_dir, flags, logs, env)
            for mode, port in (("node", cluster.node_port), ("router", cluster.router_port)):
                targets[mode] = Target(mode, args.output_len, address=f"127.0.0.1:{port}")
        if set(ENGINE_MODES) & set(args.modes):
            if args.torch_threads:
                import torch

                torch.set_num_threads(args.torch_threads)
            llm = LLM(str(model_dir), **engine_kwargs_of(flags))
            thread = EngineThread(llm.llm_engine, name="engine-bench").start()
            for mode in ENGINE_MODES:
                targets[mode] = Target(mode, args.output_len, thread=thread)
            GilProbe(lambda lags: local_lags.append((time.monotonic(), lags)))
        if cluster is not None:
            ready = targets["router"]
            await cluster.wait_ready(
                lambda: ready.start("ready", [1, 2, 3], {}), args.start_timeout
            )
        sweeps: list[dict[str, Any]] = []
        k = 0
        for rnd in range(args.warmup_rounds + args.rounds):
            for rate in args.request_rate:
                for mode in args.modes:
                    native = thread._thread if thread is not None else None
                    s = await one_sweep(
                        args, mode, targets, cluster, native, local_lags, k, rnd, rate
                    )
                    sweeps.append({"round": rnd, "warmup": rnd < args.warmup_rounds, **s})
                    print(f"round {rnd} rate {rate:g} {line(mode, s)}", flush=True)
                    k += 1
        return sweeps
    finally:
        for target in targets.values():
            await target.close()
        if thread is not None:
            thread.stop()
        if cluster is not None:
            cluster.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_dir(args.shape, tmp)
        logs = args.out / "serve_path_logs" if args.out else Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        sweeps = asyncio.run(run(args, model_dir, logs))
    summary = summarize_rounds(args, [s for s in sweeps if not s["warmup"]])
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = {"sweeps": sweeps, "summary": summary}
    record = {"environment": environment(), "parameters": params, "results": results}
    path, _ = write_record("serve_path", record, command_line("serve_path.py", argv), args.out)
    print(f"record: {path}")
    return record


if __name__ == "__main__":
    main()
