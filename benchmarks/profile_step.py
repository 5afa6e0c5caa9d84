"""Where a decode step's time goes: kernels on the device, Python on the host.

    python benchmarks/profile_step.py kernels --shape qwen3-0.6b --batch 1
    python benchmarks/profile_step.py host --shape qwen3-0.6b --num-seqs 256

``kernels`` (CUDA only): one decode step of ``--batch`` sequences at ``--context`` tokens,
exactly as model_step.py times it (graph replay when captured, logits,
sampling), under torch.profiler: every device kernel with its count and time
per step, the step's device busy time and its wall time. The gap between the
two is launch and host overhead; the kernel table says which kernels a fusion
or a cheaper launch would remove.

``host``: the offline nano-vllm workload of offline_throughput.py, once the
batch is full: ``--steps`` engine steps timed, split into the model's calls
(forward or graph replay, logits, sampling), the wait for the device, and the
rest, which is the engine's host work per step; then ``--steps`` more under
cProfile: the Python functions by own time per step. With async scheduling the
host work overlaps the device; the table still says what the host spends and
where. On a CPU, ``--shape tiny`` makes the model's share small, so the run
measures the host work itself:

    python benchmarks/profile_step.py host --shape tiny --num-seqs 256 --min-len 16 --max-len 128

Both print a table and write a JSON record (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import command_line, environment, write_record
from engine.models.shapes import SHAPES, write_shape_dir


def kernels(args) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.model_step import decode_step, make_runner

    ns = argparse.Namespace(
        backend=args.backend,
        no_fused_ops=False,
        enforce_eager=args.enforce_eager,
        gemv_backend=args.gemv_backend,
    )
    ctx, batch = args.context, args.batch
    blocks_per_seq = -(-(ctx + 1) // 16)
    with tempfile.TemporaryDirectory() as tmp:
        runner = make_runner(args.shape, tmp, ns, ctx + 16, batch * blocks_per_seq + 1, batch)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    inputs = runner.build_inputs([[1] * (ctx + 1)] * batch, [ctx] * batch, [1] * batch, tables)
    on_cuda = runner.device.type == "cuda"
    step = decode_step(runner, inputs, batch)

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    with torch.inference_mode():
        for _ in range(5):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.iters
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(args.iters):
                step()
            sync()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if on_cuda and evt.device_type.name != "CUDA":
            continue
        if not on_cuda and evt.cpu_parent is not None:
            continue  # CPU: top-level ops only
        row = per_kernel[evt.name]
        row[0] += 1
        row[1] += (evt.device_time if on_cuda else evt.cpu_time) / 1e3  # ms
    rows = sorted(
        (
            {
                "kernel": name[:120],
                "per_step": count / args.iters,
                "ms_per_step": ms / args.iters,
                "us_each": 1e3 * ms / count,
            }
            for name, (count, ms) in per_kernel.items()
        ),
        key=lambda r: -r["ms_per_step"],
    )
    busy = sum(r["ms_per_step"] for r in rows)
    count = sum(r["per_step"] for r in rows)
    print(
        f"{args.shape} batch {batch} ctx {ctx} backend {runner.attention_backend.name.value} "
        f"graphs={runner.graphs is not None}: wall {wall_ms:.3f} ms/step, device busy "
        f"{busy:.3f} ms/step over {count:.0f} kernels ({1e3 * busy / max(count, 1):.2f} us each)"
    )
    print(f"{'ms/step':>8} {'n/step':>7} {'us each':>8}  kernel")
    for r in rows[: args.top]:
        print(f"{r['ms_per_step']:8.4f} {r['per_step']:7.1f} {r['us_each']:8.2f}  {r['kernel']}")
    return {
        "shape": args.shape,
        "batch": batch,
        "context": ctx,
        "backend": runner.attention_backend.name.value,
        "cuda_graphs": runner.graphs is not None,
        "wall_ms_per_step": wall_ms,
        "device_busy_ms_per_step": busy,
        "kernels_per_step": count,
        "kernels": rows,
    }


class _Stopwatch:
    """Accumulates the time spent inside wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def _time_steps(engine, steps: int, model_clock: _Stopwatch, wait_clock: _Stopwatch):
    """(wall, model, wait) seconds per step over ``steps`` engine steps."""
    model_clock.seconds = wait_clock.seconds = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - t0) / steps
    return wall, model_clock.seconds / steps, wait_clock.seconds / steps


def host(args) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from engine.async_step import InFlightStep
    from engine.sampling_params import RequestOutputKind

    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000) for _ in range(rng.randint(args.min_len, args.max_len))]
        for _ in range(args.num_seqs)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_dir(args.shape, Path(tmp) / args.shape)
        llm = LLM(
            str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            attention_backend=args.backend,
            max_model_len=4096,
            max_num_seqs=args.num_seqs,
            enforce_eager=args.enforce_eager,
            # Only when asked: this script also measures engines older than the option.
            **({"gemv_backend": args.gemv_backend} if args.gemv_backend != "auto" else {}),
            async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        )
    engine = llm.llm_engine
    runner = engine.model_runner
    # Every sequence keeps decoding through the timed and the profiled steps.
    max_tokens = max(args.max_len, 2 * args.steps + 16)
    kind = RequestOutputKind[args.output_kind.upper()]
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{i}",
            {"prompt_token_ids": p},
            SamplingParams(
                temperature=0.6, ignore_eos=True, max_tokens=max_tokens, output_kind=kind
            ),
        )
    # The device's share of a step: the forward (or graph replay), logits and
    # sampling calls (on a CPU their compute, on CUDA their launches), and the
    # wait for a step's samples. Everything else is the engine's host work.
    model_clock, wait_clock = _Stopwatch(), _Stopwatch()
    runner.model.forward = model_clock.wrap(runner.model.forward)
    runner.model.compute_logits = model_clock.wrap(runner.model.compute_logits)
    runner.sampler.sample = model_clock.wrap(runner.sampler.sample)
    if runner.graphs is not None:
        runner.graphs.run = model_clock.wrap(runner.graphs.run)
    # The engine reads a step with InFlightStep.read (older engines: wait).
    wait_name = "read" if hasattr(InFlightStep, "read") else "wait"
    original_wait = getattr(InFlightStep, wait_name)
    if runner.device.type == "cuda":
        setattr(InFlightStep, wait_name, wait_clock.wrap(original_wait))
    try:
        # Run the prefills until every sequence decodes, then time decode steps.
        while engine.scheduler.waiting:
            engine.step()
        for _ in range(5):
            engine.step()
        wall, model, wait = _time_steps(engine, args.steps, model_clock, wait_clock)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            engine.step()
        prof.disable()
        wall_profiled = (time.perf_counter() - t0) / args.steps
    finally:
        setattr(InFlightStep, wait_name, original_wait)
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(file).name}:{line}:{fn}",
                "calls_per_step": nc / args.steps,
                "own_ms_per_step": 1e3 * tt / args.steps,
                "cum_ms_per_step": 1e3 * ct / args.steps,
            }
        )
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    running = len(engine.scheduler.running)
    host_ms = 1e3 * (wall - model - wait)
    print(
        f"{args.shape} {running} running, async={engine.async_scheduling}, output_kind="
        f"{kind.name}: {1e3 * wall:.3f} ms/step wall, of which model calls {1e3 * model:.3f}, "
        f"waiting for the device {1e3 * wait:.3f}, host work {host_ms:.3f} ms/step"
    )
    print(f"under cProfile: {1e3 * wall_profiled:.3f} ms/step wall")
    print(f"{'own ms':>8} {'cum ms':>8} {'calls':>8}  function (per step)")
    for r in rows[: args.top]:
        print(
            f"{r['own_ms_per_step']:8.3f} {r['cum_ms_per_step']:8.3f} "
            f"{r['calls_per_step']:8.1f}  {r['function']}"
        )
    return {
        "shape": args.shape,
        "running": running,
        "async_scheduling": engine.async_scheduling,
        "output_kind": kind.name,
        "wall_ms_per_step": 1e3 * wall,
        "model_ms_per_step": 1e3 * model,
        "wait_ms_per_step": 1e3 * wait,
        "host_ms_per_step": host_ms,
        "wall_ms_per_step_profiled": 1e3 * wall_profiled,
        "functions": rows[:80],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["kernels", "host"])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gemv-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    p.add_argument(
        "--output-kind",
        choices=["cumulative", "delta", "final_only"],
        default="final_only",
        help="host: what each step reports per request (LLM.generate: final_only; "
        "the nodes: delta)",
    )
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    result = kernels(args) if args.what == "kernels" else host(args)
    record = {"environment": environment(), "results": result}
    path, _ = write_record(
        f"profile_{args.what}", record, command_line("profile_step.py", argv), args.out_dir
    )
    print(f"record: {path}")
    return result


if __name__ == "__main__":
    main()
