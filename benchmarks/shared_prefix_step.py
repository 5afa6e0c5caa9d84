"""Why a shared-prefix serving load decodes slower than a random one (issue 17).

    python benchmarks/shared_prefix_step.py --shape llama-3.1-8b --batches 32,64,128

The serving benchmark's shared-prefix workload (G groups sharing a long system
prompt) shows pdserve's TPOT growing with the rate much faster than vLLM's,
while on the random workload both grow alike. This times the steps such a load
is made of, one variable at a time, on one ModelRunner:

- ``decode distinct``: B sequences of C tokens of context, each its own blocks
  (the random workload's kind of batch);
- ``decode shared``: the same, but the first ``--system-len`` tokens of each
  sequence are one of G groups' blocks, the batch in a shuffled order (as the
  scheduler's arrival order leaves it);
- ``decode shared sorted``: the same batch ordered by group;
- ``decode shared eager``: the shuffled batch without the CUDA graph;
- ``mixed``: the shuffled batch plus one new request's prefill of
  ``--question-len`` tokens whose first ``--system-len`` are cached (what every
  step carries when a request arrives per step); always eager;
- ``mixed piecewise`` (with ``--piecewise``): the same step through the
  piecewise CUDA graphs (engine/piecewise_graphs.py), attention eager between
  the pieces, with its largest deviation from the eager step's hidden states.

With ``--scatter``, every block id goes through one random permutation of a
pool of ``--pool-blocks`` (a serving node's cache after its first blocks were
evicted and handed out again in LRU order) instead of contiguous runs.

Each: median wall time per step over CUDA events, the host's own time to
enqueue the step (no device wait), and for ``--profile-batch`` a kernel table
under torch.profiler (device busy time per step by kernel). Prints a table,
writes a JSON record (benchmarks/results/).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cuda_time_ms, save_run
from benchmarks.model_step import make_runner

BLOCK = 16


def tables_for(kind: str, batch: int, args) -> tuple[list[list[int]], list[int]]:
    """Block tables of ``batch`` sequences and each sequence's group (-1: none)."""
    ctx = args.context
    blocks_per_seq = -(-(ctx + 1) // BLOCK)
    if kind == "distinct":
        return [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)], [
            -1
        ] * batch
    prefix_blocks = args.system_len // BLOCK
    own = blocks_per_seq - prefix_blocks
    rng = random.Random(0)
    groups = [i % args.groups for i in range(batch)]
    rng.shuffle(groups)
    if kind == "shared sorted":
        groups.sort()
    first_own = args.groups * prefix_blocks
    tables = []
    for i, g in enumerate(groups):
        shared = list(range(g * prefix_blocks, (g + 1) * prefix_blocks))
        tables.append(shared + list(range(first_own + i * own, first_own + (i + 1) * own)))
    return tables, groups


def host_ms(fn, iters: int = 10) -> float:
    """The host's time to enqueue one step (median; the device is drained before each)."""
    import torch

    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def kernel_table(fn, steps: int = 5, top: int = 8) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[evt.name] += evt.device_time_total / 1e3 / steps
    busy = sum(per_kernel.values())
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {"busy_ms": busy, "top": [{"kernel": k[:90], "ms": v} for k, v in ranked]}


def host_profile(fn, steps: int = 10, top: int = 25) -> list[dict[str, Any]]:
    """The Python functions an eager step spends its host time in (cProfile, own time)."""
    import cProfile
    import pstats

    import torch

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({name})",
                "calls_per_step": calls / steps,
                "own_ms": own / steps * 1e3,
                "cum_ms": cum / steps * 1e3,
            }
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def step_fn(runner, inputs, batch_rows: int, use_graph: bool | str):
    from engine.layers.sampler import SamplingRow
    from engine.sampling_params import SamplingParams

    greedy = [SamplingRow(SamplingParams(temperature=0), [1], 1, None, [])] * batch_rows
    last = inputs.meta.query_start_loc[1:].long() - 1

    def step():
        if use_graph == "piecewise":
            hidden = runner.piecewise.run(inputs)[last]
        elif use_graph and runner.graphs is not None and runner.graphs.can_run(inputs):
            hidden = runner.graphs.run(inputs)
        else:
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)[last]
        runner.sampler(runner.model.compute_logits(hidden), greedy)

    return step


def run(args) -> list[dict[str, Any]]:
    import torch

    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    blocks_per_seq = -(-(ctx + 1) // BLOCK)
    num_blocks = max(batches) * blocks_per_seq + args.groups * blocks_per_seq + 64
    num_blocks = max(num_blocks, args.pool_blocks)
    perm = list(range(num_blocks))
    if args.scatter:
        random.Random(1).shuffle(perm)

    def scattered(tables: list[list[int]]) -> list[list[int]]:
        return [[perm[b] for b in t] for t in tables]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runner = make_runner(args.shape, tmp, args, ctx + 4 * BLOCK, num_blocks, max(batches) + 1)
        for batch in batches:
            cases = []
            for kind in ("distinct", "shared", "shared sorted"):
                tables = scattered(tables_for(kind, batch, args)[0])
                inputs = runner.build_inputs(
                    [[1] * (ctx + 1)] * batch, [ctx] * batch, [1] * batch, tables
                )
                cases.append((f"decode {kind}", inputs, batch, True))
            tables = scattered(tables_for("shared", batch, args)[0])
            inputs = runner.build_inputs(
                [[1] * (ctx + 1)] * batch, [ctx] * batch, [1] * batch, tables
            )
            cases.append(("decode shared eager", inputs, batch, False))
            # One new request of group 0: its system prompt's blocks are cached, its question is new.
            prefix_blocks = args.system_len // BLOCK
            new_len = args.system_len + args.question_len
            new_table = list(range(prefix_blocks)) + list(
                range(num_blocks - 1 - (-(-args.question_len // BLOCK)), num_blocks - 1)
            )
            (new_table,) = scattered([new_table])
            mixed = runner.build_inputs(
                [[1] * (ctx + 1)] * batch + [[1] * new_len],
                [ctx] * batch + [args.system_len],
                [1] * batch + [args.question_len],
                tables + [new_table],
            )
            cases.append(("mixed", mixed, batch + 1, False))
            deviation = None
            if args.piecewise:
                assert runner.piecewise is not None and runner.piecewise.can_run(mixed)
                cases.append(("mixed piecewise", mixed, batch + 1, "piecewise"))
                with torch.inference_mode():
                    eager = runner.model(mixed.input_ids, mixed.positions, mixed.meta).float()
                    pw = runner.piecewise.run(mixed).float()
                    deviation = ((pw - eager).abs().max() / eager.abs().max()).item()
            for name, inp, nrows, graph in cases:
                fn = step_fn(runner, inp, nrows, graph)
                with torch.inference_mode():
                    ms = cuda_time_ms(fn, warmup=3, iters=args.iters)
                    host = host_ms(fn)
                    prof = kernel_table(fn) if batch == args.profile_batch else None
                    py = host_profile(fn) if prof is not None and graph is not True else None
                row = {
                    "batch": batch,
                    "case": name,
                    "step_ms": ms,
                    "host_ms": host,
                    "profile": prof,
                    "host_profile": py,
                }
                dev = ""
                if graph == "piecewise":
                    row["max_rel_deviation_from_eager"] = deviation
                    dev = f"  max |diff| vs eager {deviation:.2e} (relative)"
                rows.append(row)
                print(
                    f"batch {batch:4d} {name:22s} step {ms:7.3f} ms  host enqueue {host:7.3f} ms"
                    + (f"  device busy {prof['busy_ms']:.3f} ms" if prof else "")
                    + dev,
                    flush=True,
                )
                if prof:
                    for k in prof["top"]:
                        print(f"      {k['ms']:7.3f} ms  {k['kernel']}", flush=True)
                if py:
                    print("      host, own time per step (cProfile):", flush=True)
                    for f in py:
                        print(
                            f"      {f['own_ms']:7.3f} ms own {f['cum_ms']:7.3f} cum "
                            f"{f['calls_per_step']:6.0f} calls  {f['function']}",
                            flush=True,
                        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--backend", default="auto")
    p.add_argument("--batches", default="32,64,128")
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--question-len", type=int, default=128)
    p.add_argument("--context", type=int, default=2240, help="each decoding sequence's tokens")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile-batch", type=int, default=128)
    p.add_argument(
        "--piecewise",
        action="store_true",
        help="capture piecewise CUDA graphs and time the mixed step through them too",
    )
    p.add_argument("--pool-blocks", type=int, default=0, help="KV blocks to allocate (at least)")
    p.add_argument("--scatter", action="store_true", help="block ids scattered over the pool")
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    # make_runner reads these model_step flags.
    args.no_fused_ops, args.enforce_eager, args.gemv_backend = False, False, "auto"
    rows = run(args)
    return save_run("shared_prefix_step", args, {"rows": rows}, argv)


if __name__ == "__main__":
    main()
