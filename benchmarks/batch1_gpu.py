"""Issue 16's items 2 and 3 on one GPU, before and after, in one call.

    git archive 340d2e1 | (mkdir -p .before && tar -x -C .before)   # the code before, once
    python benchmarks/batch1_gpu.py --before .before --out-dir $OUT   # about 8 min on an H200

Each step is its own process (one's memory never sizes the next one's KV
cache), all with the triton attention backend (the one these changes touch;
``auto`` would pick FlashAttention where it is installed); "after" runs this tree, "before" runs the ``--before`` tree with its
own scripts (PYTHONPATH set to it), both in this session on this GPU:

1. tune_gemv.py --write-table: the skinny GEMM's configs against cuBLAS for
   the Qwen3-0.6B and Llama-3.1-8B projections (after only; the table it
   writes is what ``gemv_backend="auto"`` then uses, and a copy goes to
   --out-dir to be committed);
2. model_step.py decode at batch 1, both shapes: before; after with
   gemv_backend torch (cuBLAS: the attention and launch changes alone) and auto;
3. profile_step.py kernels, Qwen3-0.6B batch 1: kernels per step, device busy
   and wall time, and the kernel table (printed as it runs);
4. offline_throughput.py, both shapes, async scheduling on;
5. profile_step.py host, Qwen3-0.6B, 256 sequences: the engine's host work per
   step (this tree's script on both engines; it drives only the old API).

Then one table: before, after, after/before. ``--budget-s`` stops starting
steps once spent; ``--only`` runs some steps, so the whole can also go in two
calls: ``--only tune,model_step,kernels`` then ``--only offline,host``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("qwen3-0.6b", "llama-3.1-8b")
STEPS = ("tune", "model_step", "kernels", "offline", "host")


class Runner:
    def __init__(self, args: argparse.Namespace, out_dir: Path, before: Path | None) -> None:
        self.args = args
        self.out_dir = out_dir
        self.before = before
        budget_s = args.budget_s
        self.deadline = time.monotonic() + budget_s
        self.rows: list[tuple[str, str, str, str]] = []

    def run(self, script: str, argv: list[str], tree: Path | None = None) -> dict | None:
        """Run benchmarks/<script> of ``tree`` (this one by default); its record's results."""
        tree = tree or ROOT
        left = self.deadline - time.monotonic()
        if left < 20:
            print(f"skipped (budget spent): {script} {' '.join(argv)}", flush=True)
            return None
        before_files = set(self.out_dir.glob("*.json"))
        cmd = [sys.executable, str(tree / "benchmarks" / script), *argv]
        cmd += ["--out-dir", str(self.out_dir)]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        print(f"$ {'(before) ' if tree != ROOT else ''}{' '.join(cmd)}", flush=True)
        start = time.monotonic()
        try:
            subprocess.run(cmd, check=True, cwd=tree, env=env, timeout=left)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            print(f"failed: {e}", flush=True)
            return None
        print(f"  ({time.monotonic() - start:.0f} s)", flush=True)
        new = sorted(set(self.out_dir.glob("*.json")) - before_files)
        return json.loads(new[-1].read_text())["results"] if new else None

    def pair(self, what: str, shape: str, before: float | None, after: float | None) -> None:
        ratio = f"{after / before:.2f}x" if before and after else ""
        fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
        self.rows.append((f"{shape} {what}", fmt(before), fmt(after), ratio))


def model_step(r: Runner) -> None:
    argv = ["decode", "--shapes", ",".join(SHAPES), "--batches", "1"]
    argv += ["--backend", r.args.attention_backend]
    after = r.run("model_step.py", [*argv, "--gemv-backends", "torch,auto"]) or {}
    before = r.run("model_step.py", argv, r.before) if r.before else {}
    ms = {
        (d["shape"], d.get("gemv_backend", "torch")): d["step_ms"] for d in after.get("decode", [])
    }
    old = {d["shape"]: d["step_ms"] for d in (before or {}).get("decode", [])}
    for shape in SHAPES:
        r.pair("batch-1 model step ms, gemv torch", shape, old.get(shape), ms.get((shape, "torch")))
        r.pair("batch-1 model step ms, gemv auto", shape, old.get(shape), ms.get((shape, "auto")))


def kernels(r: Runner) -> None:
    argv = ["kernels", "--shape", SHAPES[0], "--batch", "1", "--backend", r.args.attention_backend]
    after = r.run("profile_step.py", argv)
    before = r.run("profile_step.py", argv, r.before) if r.before else None
    for key, label in (
        ("wall_ms_per_step", "batch-1 step wall ms (profile)"),
        ("device_busy_ms_per_step", "batch-1 device busy ms"),
        ("kernels_per_step", "batch-1 kernels per step"),
    ):
        r.pair(label, SHAPES[0], (before or {}).get(key), (after or {}).get(key))


def offline(r: Runner) -> None:
    for shape in SHAPES:
        argv = ["--shape", shape, "--device", "cuda", "--async-scheduling", "on"]
        argv += ["--attention-backend", r.args.attention_backend]
        after = r.run("offline_throughput.py", argv)
        before = r.run("offline_throughput.py", argv, r.before) if r.before else None
        tok = lambda res: res["pdserve"]["output_tok_per_s"] if res else None  # noqa: E731
        r.pair("offline output tok/s (async on)", shape, tok(before), tok(after))


def host(r: Runner) -> None:
    shape = r.args.host_shape
    argv = ["host", "--shape", shape, "--num-seqs", "256", "--steps", "30", "--top", "25"]
    argv += ["--backend", r.args.attention_backend]
    for kind in ("final_only", "delta"):
        args = [*argv, "--output-kind", kind]
        after = r.run("profile_step.py", args)
        before = None
        if r.before:
            # This tree's script (it reports host ms/step) on the old engine.
            shutil.copy(
                ROOT / "benchmarks" / "profile_step.py",
                r.before / "benchmarks" / "profile_step_now.py",
            )
            before = r.run("profile_step_now.py", args, r.before)
        ms = [(res or {}).get("host_ms_per_step") for res in (before, after)]
        r.pair(f"host ms/step, 256 seqs, {kind}", shape, *ms)


def tune(r: Runner) -> None:
    # Its second round gets what the other steps (about 7 minutes) leave.
    budget = max(20.0, min(90.0, r.deadline - time.monotonic() - 450))
    res = r.run("tune_gemv.py", ["--write-table", "--budget-s", f"{budget:.0f}"])
    if res and res.get("table"):
        name = Path(res["table"]).name
        shutil.copy(res["table"], r.out_dir / name)
        print(f"tuned table: {r.out_dir / name} (commit as engine/layers/skinny_gemm_configs/)")


def main(argv: list[str] | None = None) -> list[tuple[str, ...]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", type=Path, help="a tree of the code before (git archive of 340d2e1)")
    p.add_argument("--out-dir", type=Path)
    p.add_argument("--budget-s", type=float, default=530.0)
    p.add_argument("--only", default=",".join(STEPS), help=f"steps to run, of {','.join(STEPS)}")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--host-shape", default=SHAPES[0], help="host step's model shape")
    args = p.parse_args(argv)
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="batch1-gpu-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    before = args.before.resolve() if args.before else None
    if before is not None and not (before / "engine").is_dir():
        raise SystemExit(f"--before {before}: no engine/ there (git archive 340d2e1 into it)")
    r = Runner(args, out_dir, before)
    steps = dict(tune=tune, model_step=model_step, kernels=kernels, offline=offline, host=host)
    for name in args.only.split(","):
        steps[name](r)
    rows = [("what", "before", "after", "after/before"), *r.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    print(f"\nrecords: {out_dir}")
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return rows


if __name__ == "__main__":
    main()
