"""Structured outputs: decoding under a nested JSON schema against unconstrained
decoding, optionally against vLLM, and the grammar compiler's latency.

``--part throughput``: dummy weights of a named shape with a real tokenizer
(``--tokenizer DIR``, the demo model's by default: its tokenizer files are
copied into the dummy model's directory, so a shape whose vocabulary is padded
past the tokenizer's, as Llama-3.1-8B's 128256 over 49152, runs too). At each
batch size, ``batch`` random-token prompts decode ``--max-tokens`` tokens
twice: unconstrained (``ignore_eos``) and under ``NESTED_SCHEMA``, whose
shortest document is far longer than ``--max-tokens``, so every constrained
row is cut by ``max_tokens`` as every unconstrained one is: the two rows of a
batch produce the same token counts (both are reported, with the rows that
ended early) and their rates compare step for step. Each run has prompts of
its own (no prefix-cache hit); the grammar is compiled in the warm-up, as a
server's cache would hold it. ``--peer vllm`` runs the same prompts and
parameters through vLLM in the same process afterwards.

``--part compile`` (CPU only): compile time of every schema of the
structured-output tests' set (tests/integration/structured_schemas.py)
through the engine's ``GrammarCompiler``, cold (a fresh compiler, its cache
empty; the tokenizer's index built before the clock starts) and cached (the
same specs again: the LRU's hit), p50/p99 over ``--compile-rounds`` rounds.

    python benchmarks/structured_outputs.py --part compile            # here
    python benchmarks/structured_outputs.py --shape llama-3.1-8b --peer vllm
"""

from __future__ import annotations

import argparse
import enum
import gc
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run, summary_ms
from engine.models.shapes import SHAPES, write_shape_dir

REPO = Path(__file__).resolve().parent.parent
DEMO_TOKENIZER = REPO / "models" / "smollm2-135m-instruct"
# What a Hugging Face tokenizer directory may hold; weights and configs stay behind.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
GPU_DEFAULTS = dict(shape="llama-3.1-8b", batch_sizes=[1, 64, 256], input_len=128, max_tokens=512)
CPU_DEFAULTS = dict(shape="smollm2-135m", batch_sizes=[1, 4], input_len=16, max_tokens=16)
WARM_UP_TOKENS = 8
# Tokens a profiled run (--trace-dir) decodes: a few steps past the prefill.
TRACE_TOKENS = 16
# Random prompt ids avoid the low ids, where tokenizers keep their special tokens.
FIRST_PROMPT_ID = 100

EMAIL_PATTERN = r"^[a-z0-9._]{1,32}@[a-z0-9]{1,24}\.[a-z]{2,6}$"
_AMOUNT = {"type": "number", "minimum": 0, "maximum": 100000}
_LINE_ITEM = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
        "price": {
            "type": "object",
            "properties": {"amount": _AMOUNT, "currency": {"enum": ["EUR", "USD", "GBP"]}},
            "required": ["amount", "currency"],
        },
        "tags": {
            "type": "array",
            "items": {"enum": ["new", "sale", "gift", "fragile"]},
            "minItems": 1,
            "maxItems": 4,
        },
        "in_stock": {"type": "boolean"},
    },
    "required": ["sku", "name", "quantity", "price", "tags", "in_stock"],
}
# The workload's schema: an order with nested objects, arrays, enums, patterns
# and bounded numbers. Its shortest document has MIN_LINE_ITEMS line items of
# over 100 characters each: an output that ended within max_tokens = 2048
# would need tokens of over 12 characters on average (rows_short_of_max_tokens
# in the record says if one did). Every string is bounded: dummy weights write
# random text wherever the grammar allows it, and an unbounded string rule
# whose mask gets dearer as it grows (xgrammar's `format: email`: one row's
# mask took 0.5 s past a few hundred characters, docs/lab/
# 2026-12-08-structured-outputs-email-format.md) would measure that rule on
# text no model writes, not structured decoding.
MIN_LINE_ITEMS = 256
NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "email": {"type": "string", "pattern": EMAIL_PATTERN},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 60},
                        "city": {"type": "string", "maxLength": 40},
                        "country": {"enum": ["DE", "FR", "GB", "US"]},
                    },
                    "required": ["street", "city", "country"],
                },
            },
            "required": ["name", "email", "address"],
        },
        "items": {"type": "array", "items": _LINE_ITEM, "minItems": MIN_LINE_ITEMS},
    },
    "required": ["order_id", "customer", "items"],
}


class Part(enum.Enum):
    THROUGHPUT = "throughput"
    COMPILE = "compile"
    ALL = "all"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", type=Part, choices=list(Part), default=Part.ALL)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), help="named model shape (dummy weights)")
    src.add_argument("--config", help="a config.json to build a dummy-weight model from")
    p.add_argument("--tokenizer", type=Path, default=DEMO_TOKENIZER, help="tokenizer directory")
    p.add_argument("--batch-sizes", type=int, nargs="+")
    p.add_argument("--input-len", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--compile-rounds", type=int, default=3, help="cold compiles of each schema")
    p.add_argument(
        "--trace-dir",
        type=Path,
        help="also profile a short run of each batch size, constrained and not (torch.profiler): "
        "a Chrome trace and the top operators by host and by device time per run go here",
    )
    p.add_argument(
        "--peer",
        choices=["vllm"],
        help="also run this engine on the same workload after pdserve (one JSON record)",
    )
    p.add_argument(
        "--out-dir", type=Path, help="where the JSON record goes (default benchmarks/results)"
    )
    # The model's own numerics: the offline suite's options that
    # vllm_peer.engine_kwargs reads, at their defaults.
    p.set_defaults(quantization=None, kv_cache_dtype="auto", kv_cache_memory_bytes=None)
    args = p.parse_args(argv)
    if args.peer and args.part == Part.COMPILE:
        p.error("--peer runs the throughput part: not with --part compile")
    return args


def resolve_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
    d = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    if args.shape is None and args.config is None:
        args.shape = d["shape"]
    args.batch_sizes = args.batch_sizes or d["batch_sizes"]
    args.input_len = args.input_len or d["input_len"]
    args.max_tokens = args.max_tokens or d["max_tokens"]
    # One engine serves every batch size; its prompts and outputs must fit.
    args.max_num_seqs = max(args.batch_sizes)
    if args.input_len + args.max_tokens > args.max_model_len:
        raise SystemExit("--input-len + --max-tokens exceeds --max-model-len")


def build_model_dir(args: argparse.Namespace, out: Path) -> Path:
    """The dummy-weight model: the shape's config.json beside the tokenizer's files."""
    if args.config:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(Path(args.config).read_text())
    else:
        write_shape_dir(args.shape, out)
    copied = [n for n in TOKENIZER_FILES if (args.tokenizer / n).is_file()]
    if not {"tokenizer.json", "tokenizer.model"} & set(copied):
        raise SystemExit(
            f"--tokenizer {args.tokenizer}: no tokenizer.json or tokenizer.model there "
            "(the demo model's: make model)"
        )
    for name in copied:
        shutil.copyfile(args.tokenizer / name, out / name)
    return out


# ------------------------------------------------------------------ workload
def make_prompts(args: argparse.Namespace, batch: int, run: int, vocab: int) -> list[list[int]]:
    """``batch`` random prompts of ``--input-len`` ids below the tokenizer's
    vocabulary; ``run`` numbers the timed runs, so no two share a prompt."""
    rng = random.Random(args.seed * 1_000_003 + run)
    top = min(vocab, 10000)
    return [
        [rng.randrange(FIRST_PROMPT_ID, top) for _ in range(args.input_len)] for _ in range(batch)
    ]


def workloads(args: argparse.Namespace, tokenizer_vocab: int) -> list[dict[str, Any]]:
    """Every timed run, in order: per batch size, unconstrained then constrained."""
    out = []
    for batch in args.batch_sizes:
        for constrained in (False, True):
            prompts = make_prompts(args, batch, len(out), tokenizer_vocab)
            out.append({"batch": batch, "constrained": constrained, "prompts": prompts})
    return out


def param_kwargs(
    args: argparse.Namespace, constrained: bool, max_tokens: int | None = None
) -> dict[str, Any]:
    """One row's sampling parameters (both engines' names; the schema passed
    apart as ``StructuredOutputsParams(json=...)``). No detokenization on
    either side: the engines' decoding is measured, not their text."""
    kw = {
        "temperature": args.temperature,
        "max_tokens": max_tokens or args.max_tokens,
        "detokenize": False,
    }
    if not constrained:
        kw["ignore_eos"] = True  # the same length as a constrained row's
    return kw


def run_rows(generate, work: dict[str, Any], max_tokens: int, step_log=None) -> dict[str, Any]:
    """Time one run; ``generate(prompts)`` returns the engine's outputs.
    ``step_log``: pdserve's engine StepLog, for the device's idle time per step
    (how long it waited for the host's work: engine/async_step.py)."""
    if step_log is not None:
        step_log.take()
    start = time.perf_counter()
    outs = generate(work["prompts"])
    elapsed = time.perf_counter() - start
    steps = step_log.take() if step_log is not None else []
    idle = [s.idle_s for s in steps if s.idle_s is not None]
    produced = [len(o.outputs[0].token_ids) for o in outs]
    reasons = Counter(str(o.outputs[0].finish_reason) for o in outs)
    return {
        "batch": work["batch"],
        "constrained": work["constrained"],
        "output_tokens": sum(produced),
        "rows_short_of_max_tokens": sum(n < max_tokens for n in produced),
        "finish_reasons": dict(sorted(reasons.items())),
        "elapsed_s": elapsed,
        "output_tok_per_s": sum(produced) / elapsed,
        "steps": len(steps) or None,
        "ms_per_step": elapsed * 1e3 / len(steps) if steps else None,
        # The device's wait for the host's work before each step, where measured.
        "device_idle_ms_per_step": sum(idle) * 1e3 / len(idle) if idle else None,
        # One row's tokens, so the record shows what the grammar let through.
        "first_row_token_ids": list(outs[0].outputs[0].token_ids),
    }


def pair_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size: both runs' rates and token counts, and the ratio."""
    rows = []
    for free, bound in zip(runs[::2], runs[1::2], strict=True):
        rows.append(
            {
                "batch": free["batch"],
                "unconstrained_tok_per_s": free["output_tok_per_s"],
                "constrained_tok_per_s": bound["output_tok_per_s"],
                "constrained_vs_unconstrained": bound["output_tok_per_s"]
                / free["output_tok_per_s"],
                "unconstrained_tokens": free["output_tokens"],
                "constrained_tokens": bound["output_tokens"],
                # Per step, where the engine counts steps (pdserve): wall time
                # and the device's wait for the host.
                "ms_per_step": [free.get("ms_per_step"), bound.get("ms_per_step")],
                "device_idle_ms_per_step": [
                    free.get("device_idle_ms_per_step"),
                    bound.get("device_idle_ms_per_step"),
                ],
            }
        )
    return rows


# ------------------------------------------------------------------ pdserve
def run_pdserve(model_dir: Path, args: argparse.Namespace, work: list[dict]) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from engine.sampling_params import StructuredOutputsParams

    llm = LLM(
        str(model_dir),
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    schema = StructuredOutputsParams(json=NESTED_SCHEMA)

    def params(constrained: bool, max_tokens: int | None = None):
        so = {"structured_outputs": schema} if constrained else {}
        return SamplingParams(**param_kwargs(args, constrained, max_tokens), **so)

    warm = [[FIRST_PROMPT_ID] * 4]
    for constrained in (False, True):  # the second compiles the schema, cached after
        llm.generate(warm, params(constrained, WARM_UP_TOKENS), use_tqdm=False)
    runner, engine = llm.llm_engine.model_runner, llm.llm_engine
    runs = [
        run_rows(
            lambda p, c=w["constrained"]: llm.generate(p, params(c), use_tqdm=False),
            w,
            args.max_tokens,
            engine.step_log,
        )
        for w in work
    ]
    if args.trace_dir is not None:
        for w in work:
            trace_run(llm, w, params(w["constrained"], TRACE_TOKENS), args.trace_dir)
    grammar = engine.structured.stats()
    result = {
        "runs": runs,
        "by_batch": pair_runs(runs),
        "attention_backend": runner.attention_backend.name.value,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "async_scheduling": engine.async_scheduling,
        "grammar_compiles": grammar.cache_misses,
        "grammar_cache_hits": grammar.cache_hits,
        "vocab_size": engine.config.model_config.vocab_size,
    }
    return result


def trace_run(llm, work: dict[str, Any], params, out_dir: Path) -> None:
    """One short run of ``work``'s prompts under torch.profiler: its Chrome
    trace and its top operators by host and by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"batch{work['batch']}-{'json_schema' if work['constrained'] else 'unconstrained'}"
    with profile(activities=activities) as prof:
        llm.generate(work["prompts"], params, use_tqdm=False)
    prof.export_chrome_trace(str(out_dir / f"{name}.json"))
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if torch.cuda.is_available():
        # The column's name differs across torch releases.
        for key in ("self_device_time_total", "self_cuda_time_total"):
            try:
                tables.append(averages.table(sort_by=key, row_limit=30))
                break
            except (AttributeError, KeyError, ValueError):
                continue
    (out_dir / f"{name}.txt").write_text("\n\n".join(tables))
    print(f"trace: {out_dir / name}.json", flush=True)


# ------------------------------------------------------------------ compile
def schema_set() -> list[dict[str, Any]]:
    """The structured-output tests' schema set (one set, kept with the tests)."""
    from tests.integration.structured_schemas import SCHEMAS

    return list(SCHEMAS)


def measure_compile(args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """Cold and cached compile times of the test schemas (and the workload's),
    through the engine's compiler."""
    from engine.sampling_params import StructuredOutputsParams
    from engine.structured.compiler import GrammarCompiler
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(args.tokenizer))
    specs = [StructuredOutputsParams(json=s) for s in schema_set()]
    workload = StructuredOutputsParams(json=NESTED_SCHEMA)
    cold, cached, nested = [], [], []
    for _ in range(args.compile_rounds):
        compiler = GrammarCompiler(
            tokenizer, "bench", vocab_size, [tokenizer.eos_token_id], len(specs) + 1, 1
        )
        compiler.warm_up().result()  # the tokenizer's index: once per tokenizer, not timed
        for so in (*specs, workload):
            elapsed_ms = _timed_compile(compiler, so)
            (nested if so is workload else cold).append(elapsed_ms)
        cached += [_timed_compile(compiler, so) for so in specs]
        compiler.shutdown()
    return {
        "schemas": len(specs),
        "rounds": args.compile_rounds,
        "vocab_size": vocab_size,
        "tokenizer_vocab": len(tokenizer),
        "cold": summary_ms(cold),
        "cached": summary_ms(cached),
        "workload_schema_cold": summary_ms(nested),
    }


def _timed_compile(compiler, so) -> float:
    start = time.perf_counter()
    compiler.submit(so).result()
    return (time.perf_counter() - start) * 1e3


# ------------------------------------------------------------------ main
def _print_pairs(name: str, result: dict[str, Any]) -> None:
    for row in result["by_batch"]:
        print(
            f"{name} batch {row['batch']}: unconstrained {row['unconstrained_tok_per_s']:.1f} "
            f"tok/s ({row['unconstrained_tokens']} tokens), json_schema "
            f"{row['constrained_tok_per_s']:.1f} tok/s ({row['constrained_tokens']} tokens) "
            f"-> {row['constrained_vs_unconstrained']:.2f}x",
            flush=True,
        )
        step_ms, idle_ms = row["ms_per_step"], row["device_idle_ms_per_step"]
        if step_ms[0] is not None:
            idle = " / ".join("-" if v is None else f"{v:.2f}" for v in idle_ms)
            print(
                f"  ms per step {step_ms[0]:.2f} / {step_ms[1]:.2f}; the device idle before "
                f"each step, ms: {idle} (unconstrained / json_schema)",
                flush=True,
            )


def run_throughput(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    from engine.tokenizer import load_tokenizer

    model_dir = build_model_dir(args, tmp / "model")
    tokenizer_vocab = len(load_tokenizer(str(model_dir)))
    work = workloads(args, tokenizer_vocab)
    results: dict[str, Any] = {"tokenizer_vocab": tokenizer_vocab}
    results["pdserve"] = ours = run_pdserve(model_dir, args, work)
    _print_pairs("pdserve", ours)
    if args.peer == "vllm":
        from benchmarks.peers.vllm_structured import run_vllm_structured

        gc.collect()  # pdserve's engine is gone: its memory back before vLLM sizes its cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results["vllm"] = peer = run_vllm_structured(model_dir, args, work)
        _print_pairs(f"vLLM {peer['version']}", peer)
        results["pdserve_vs_vllm"] = [
            {
                "batch": a["batch"],
                "constrained": a["constrained_tok_per_s"] / b["constrained_tok_per_s"],
                "unconstrained": a["unconstrained_tok_per_s"] / b["unconstrained_tok_per_s"],
            }
            for a, b in zip(ours["by_batch"], peer["by_batch"], strict=True)
        ]
        for row in results["pdserve_vs_vllm"]:
            print(f"pdserve / vLLM, batch {row['batch']}: json_schema {row['constrained']:.2f}x")
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    resolve_defaults(args, on_gpu)
    # The grammar library both engines use here (vLLM's own, where it is carried).
    results: dict[str, Any] = {"xgrammar": version("xgrammar"), "schema": NESTED_SCHEMA}
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in (Part.THROUGHPUT, Part.ALL):
            results.update(run_throughput(args, Path(tmp)))
        if args.part in (Part.COMPILE, Part.ALL):
            from engine.models.config import ModelArchConfig

            vocab = ModelArchConfig.from_dir(build_model_dir(args, Path(tmp) / "c")).vocab_size
            results["compile"] = c = measure_compile(args, vocab)
            print(
                f"compile over {c['schemas']} test schemas x {c['rounds']}: cold p50 "
                f"{c['cold']['p50_ms']:.2f} ms p99 {c['cold']['p99_ms']:.2f} ms; cached p50 "
                f"{c['cached']['p50_ms']:.4f} ms p99 {c['cached']['p99_ms']:.4f} ms",
                flush=True,
            )
    args.part = args.part.value
    return save_run("structured_outputs", args, results, argv)


if __name__ == "__main__":
    main()
