"""Which Triton kernels a serving workload still compiles after start-up, and
what each compile costs the step it lands in.

    TRITON_CACHE_DIR=/tmp/fresh python benchmarks/jit_stalls.py --shape llama-3.1-8b

A Triton kernel is compiled once per variant: its constexprs, and whether each
integer argument is 1 or a multiple of 16 and each pointer 16-byte aligned.
A variant first met under load compiles inside a step, and every request
waits that long. This builds an engine as a node does (dummy weights of
``--shape``, CUDA graphs), then feeds it ``--requests`` random prompts
arriving at ``--request-rate`` (as the serving benchmark's random workload
does), stepping it as the node's engine thread does, and lists every kernel
variant that appeared in Triton's on-disk cache (``TRITON_CACHE_DIR``: start
it empty to see a fresh host) with the step time it landed in.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run, triton_cache_entries


def variant(path: Path) -> dict:
    """What Triton's metadata file says of a compiled variant (its kernel's name,
    warps and stages; the specialisation itself is not in it)."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"name": path.stem}
    return {k: meta[k] for k in ("name", "num_warps", "num_stages") if k in meta}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=32.0)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument(
        "--stall-ms", type=float, default=200.0, help="steps slower than this are listed"
    )
    p.add_argument("--engine-args", default="", help="extra EngineConfig fields, k=v,k=v")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.shapes import write_shape_dir
    from engine.sampling_params import SamplingParams

    model = write_shape_dir(args.shape, tempfile.mkdtemp(prefix="jit-stalls-"))
    kwargs = {"load_format": "dummy", "skip_tokenizer_init": True, "max_model_len": 4096}
    for item in filter(None, args.engine_args.split(",")):
        key, value = item.split("=", 1)
        kwargs[key] = int(value) if value.isdigit() else value
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_kwargs(str(model), **kwargs))
    start_s = time.perf_counter() - started
    at_start = triton_cache_entries()
    print(f"engine ready in {start_s:.1f} s; {len(at_start)} kernel variants cached")

    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=1.0)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.request_rate)
        arrivals.append(t)
    seen = set(at_start)
    compiled, steps = [], []
    sent, clock0 = 0, time.perf_counter()
    while sent < len(arrivals) or engine.has_unfinished_requests():
        now = time.perf_counter() - clock0
        while sent < len(arrivals) and arrivals[sent] <= now:
            prompt = [rng.randrange(10, 30000) for _ in range(args.input_len)]
            engine.add_request(f"r{sent}", {"prompt_token_ids": prompt}, params)
            sent += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[sent] - now))
            continue
        step_start = time.perf_counter()
        engine.step()
        step_ms = (time.perf_counter() - step_start) * 1e3
        steps.append(step_ms)
        new = triton_cache_entries() - seen
        for path in new:
            found = variant(path)
            compiled.append({"step": len(steps), "step_ms": step_ms, **found})
            print(f"step {len(steps)} ({step_ms:.0f} ms) compiled {found.get('name', path.stem)}")
        seen |= new
    steps_sorted = sorted(steps)
    results = {
        "engine_start_s": start_s,
        "variants_cached_at_start": len(at_start),
        "compiled_after_start": compiled,
        "num_steps": len(steps),
        "step_ms_p50": steps_sorted[len(steps) // 2],
        "step_ms_max": steps_sorted[-1],
        "slow_steps": [(i + 1, ms) for i, ms in enumerate(steps) if ms > args.stall_ms],
        "wall_s": time.perf_counter() - clock0,
    }
    print(
        f"{len(compiled)} variants compiled after start-up; steps p50 "
        f"{results['step_ms_p50']:.1f} ms, max {results['step_ms_max']:.0f} ms, "
        f"{len(results['slow_steps'])} over {args.stall_ms:.0f} ms"
    )
    save_run("jit_stalls", args, results, argv)


if __name__ == "__main__":
    main()
