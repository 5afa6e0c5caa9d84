"""Speculative decoding: output tok/s with and without it, by batch size, same run.

Two parts (docs/performance.md, "Speculative decoding"):

``--part mechanics`` (dummy weights, any device): a Llama-3.1-8B-shaped target
with a Llama-3.2-1B-shaped draft model. Dummy weights never agree, so the
draft's proposals are swapped for a replay of the target's own greedy tokens,
recorded in the run without speculation over the same prompts, each token
corrupted with probability ``1 - acceptance`` (benchmarks/support/
replay_proposer.py); the draft model still runs for its cost. Per batch size,
output tok/s for each acceptance against no speculation, and the acceptance
observed: the cost and the ceiling of the mechanics.

``--part ngram`` (real weights and tokenizer, ``--model DIR``): n-gram prompt
lookup on an input-grounded workload (correct a given text's spelling:
benchmarks/support/edit_workload.py), per batch size and ``k`` against no
speculation; ``--peer vllm`` runs vLLM's n-gram on the same prompts after.

Every run is greedy with prefix caching off (the runs repeat prompts); a
batch size B runs its prompts in closed groups of B (one ``generate`` each),
after one short untimed group.

    python benchmarks/spec_decode.py --part mechanics              # GPU: 8B + 1B shapes
    python benchmarks/spec_decode.py --part ngram --model models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import enum
import gc
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import save_run
from engine.models.shapes import SHAPES, write_shape_dir


class Part(enum.StrEnum):  # a str: the record's parameters name it as typed
    MECHANICS = "mechanics"
    NGRAM = "ngram"


class Speculation(enum.StrEnum):
    """What a row's run proposed."""

    NONE = "none"  # an engine without speculative_config
    OPTED_OUT = "opted_out"  # the speculating engine, every request opted out
    REPLAY = "replay"  # the draft model's proposals replaced by the replay
    NGRAM = "ngram"


GPU_DEFAULTS = dict(
    shape="llama-3.1-8b", draft_shape="llama-3.2-1b", batch_sizes=[1, 8, 32], min_prompts=4
)
CPU_DEFAULTS = dict(shape="tiny", draft_shape="tiny", batch_sizes=[1, 4], min_prompts=4)
WARM_UP_TOKENS = 8
DEFAULT_K = {Part.MECHANICS: [4], Part.NGRAM: [3, 4, 5]}

# Generates token id lists for (prompts, max_tokens) in one call.
Generate = Callable[[list[list[int]], list[int]], list[list[int]]]


@dataclass(slots=True)
class EngineFamily:
    """How the ngram part drives one engine: one instance per speculative
    config (None: none), its generate, its spec-decode counters, its close."""

    name: str
    open: Callable[[dict | None], Any]
    generate: Callable[[Any], Generate]
    stats: Callable[[Any], Any]
    close: Callable[[Any], None]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", type=Part, choices=list(Part), required=True)
    p.add_argument("--batch-sizes", type=_ints, help="comma-separated (GPU 1,8,32; CPU 1,4)")
    p.add_argument("--min-prompts", type=int, help="prompts per batch size, at least (4)")
    p.add_argument("--num-speculative-tokens", type=_ints, help="k, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--out-dir", type=Path, help="where the JSON record goes (default benchmarks/results)"
    )
    m = p.add_argument_group("mechanics")
    m.add_argument("--shape", choices=sorted(SHAPES), help="the target's (GPU llama-3.1-8b)")
    m.add_argument("--draft-shape", choices=sorted(SHAPES), help="the draft's (llama-3.2-1b)")
    m.add_argument("--acceptance", type=_floats, default=[0.0, 0.5, 0.8, 1.0])
    m.add_argument("--input-len", type=int, default=512)
    m.add_argument("--output-len", type=int, default=256)
    g = p.add_argument_group("ngram")
    g.add_argument("--model", type=Path, help="a model directory with weights and tokenizer")
    g.add_argument("--prompt-lookup-max", type=int, default=4)
    g.add_argument("--prompt-lookup-min", type=int, default=2)
    g.add_argument("--peer", choices=["vllm"], help="also run vLLM's n-gram, after pdserve")
    args = p.parse_args(argv)
    if args.part is Part.NGRAM and args.model is None:
        p.error("--part ngram needs --model DIR (real weights and a tokenizer)")
    if args.part is Part.MECHANICS and args.peer:
        p.error("--peer is for --part ngram (vLLM cannot take the replayed proposals)")
    return args


def resolve_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
    d = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    args.shape = args.shape or d["shape"]
    args.draft_shape = args.draft_shape or d["draft_shape"]
    args.batch_sizes = args.batch_sizes or d["batch_sizes"]
    args.min_prompts = args.min_prompts or d["min_prompts"]
    args.num_speculative_tokens = args.num_speculative_tokens or DEFAULT_K[args.part]


def prompts_for(batch: int, min_prompts: int) -> int:
    """Whole groups of ``batch``, at least ``min_prompts`` prompts."""
    return max(1, -(-min_prompts // batch)) * batch


def warm_up(generate: Generate, prompts: list[list[int]], lens: list[int], batch: int) -> None:
    """One short group, untimed: the kernels this batch size's steps need
    compile (Triton's JIT, a verify step's shapes) before the timed runs."""
    generate(prompts[:batch], [min(WARM_UP_TOKENS, n) for n in lens[:batch]])


def timed_groups(
    generate: Generate, prompts: list[list[int]], max_tokens: list[int], batch: int
) -> tuple[list[list[int]], float]:
    """Run ``prompts`` in closed groups of ``batch``; (outputs, seconds)."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += generate(prompts[i : i + batch], max_tokens[i : i + batch])
    return outputs, time.perf_counter() - start


def rate_row(engine: str, batch: int, outputs: list[list[int]], elapsed: float, **extra) -> dict:
    produced = sum(map(len, outputs))
    return {
        "engine": engine,
        "batch_size": batch,
        **extra,
        "output_tokens": produced,
        "elapsed_s": elapsed,
        "output_tok_per_s": produced / elapsed,
    }


def acceptance(before, after) -> dict[str, float]:
    """vLLM's acceptance figures between two counter snapshots (draft tokens
    kept / proposed; tokens emitted per verifying sequence and step)."""
    drafts = after.num_drafts - before.num_drafts
    proposed = after.num_draft_tokens - before.num_draft_tokens
    kept = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "acceptance_rate": kept / proposed if proposed else 0.0,
        "mean_acceptance_length": 1.0 + kept / drafts if drafts else 0.0,
    }


def same_share(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The share of sequences whose tokens equal the reference's (greedy is exact)."""
    return sum(a == b for a, b in zip(outputs, reference, strict=True)) / len(reference)


def free_memory() -> None:
    """Let the next engine of the run size its cache on a free GPU."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------- pdserve
def open_pdserve(model_dir: Path, args, dummy: bool, speculative_config: dict | None):
    from engine import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        load_format="dummy" if dummy else "auto",
        skip_tokenizer_init=dummy,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max(args.batch_sizes),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=False,
        seed=args.seed,
        speculative_config=speculative_config,
    )
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm


def pdserve_generate(llm, ignore_eos: bool = False, opt_out: bool = False) -> Generate:
    """Greedy; ``opt_out``: every request opts out of the engine's speculation."""
    from engine import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=ignore_eos, disable_spec_decode=opt_out
            )
            for n in max_tokens
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def spec_stats(llm):
    return llm.llm_engine.speculator.stats.copy()


def engine_facts(llm) -> dict[str, Any]:
    runner = llm.llm_engine.model_runner
    return {
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "attention_backend": runner.attention_backend.name.value,
        "async_scheduling": llm.llm_engine.async_scheduling,
    }


# --------------------------------------------------------------- mechanics
def mechanics_prompts(args, vocab_size: int) -> list[list[int]]:
    """Distinct random prompts (the replay tells sequences apart by prompt)."""
    rng = random.Random(args.seed)
    num = max(prompts_for(b, args.min_prompts) for b in args.batch_sizes)
    return [
        [rng.randrange(min(10000, vocab_size)) for _ in range(args.input_len)] for _ in range(num)
    ]


def run_mechanics(args, target_dir: Path, draft_dir: Path, vocab_size: int) -> dict[str, Any]:
    from benchmarks.support.replay_proposer import ReplayProposer

    pool = mechanics_prompts(args, vocab_size)
    base = open_pdserve(target_dir, args, True, None)
    references, rows = {}, []
    for batch in args.batch_sizes:
        prompts = pool[: prompts_for(batch, args.min_prompts)]
        lens = [args.output_len] * len(prompts)
        warm_up(pdserve_generate(base, True), prompts, lens, batch)
        outs, elapsed = timed_groups(pdserve_generate(base, True), prompts, lens, batch)
        references[batch] = outs
        rows.append(rate_row("pdserve", batch, outs, elapsed, speculation=Speculation.NONE))
        print(f"batch {batch:>3} none: {rows[-1]['output_tok_per_s']:9.1f} tok/s", flush=True)
    facts = {"none": engine_facts(base)}
    del base
    free_memory()
    for k in args.num_speculative_tokens:
        config = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
        llm = open_pdserve(target_dir, args, True, config)
        speculator = llm.llm_engine.speculator
        # The benchmark's seam: the draft model's proposer, wrapped by the replay.
        replay = ReplayProposer(speculator.draft, vocab_size)
        speculator.draft = replay
        facts[f"k={k}"] = engine_facts(llm)
        for batch in args.batch_sizes:
            rows += _replayed(llm, replay, args, pool, references[batch], batch, k)
        del llm, speculator, replay
        free_memory()
    _add_speedups(rows, "pdserve")
    return {"rows": rows, "engines": facts}


def _replayed(llm, replay, args, pool, reference, batch: int, k: int) -> list[dict]:
    rows = []
    prompts = pool[: len(reference)]
    lens = [args.output_len] * len(prompts)
    replay.start_run(prompts, reference, 0.5, args.seed)
    warm_up(pdserve_generate(llm, True), prompts, lens, batch)
    # This engine's steps are synchronous: its own run without proposals tells
    # that cost apart from the proposals' (and checks the reference again).
    warm_up(pdserve_generate(llm, True, True), prompts, lens, batch)
    outs, elapsed = timed_groups(pdserve_generate(llm, True, True), prompts, lens, batch)
    rows.append(
        rate_row(
            "pdserve", batch, outs, elapsed, speculation=Speculation.OPTED_OUT,
            num_speculative_tokens=k, outputs_equal_reference=same_share(outs, reference),
        )
    )  # fmt: skip
    for rate in args.acceptance:
        replay.start_run(prompts, reference, rate, args.seed)
        before = spec_stats(llm)
        outs, elapsed = timed_groups(pdserve_generate(llm, True), prompts, lens, batch)
        rows.append(
            rate_row(
                "pdserve", batch, outs, elapsed, speculation=Speculation.REPLAY, num_speculative_tokens=k,
                acceptance_set=rate, **acceptance(before, spec_stats(llm)),
                outputs_equal_reference=same_share(outs, reference),
            )
        )  # fmt: skip
        r = rows[-1]
        print(
            f"batch {batch:>3} k={k} replay {rate:.0%}: {r['output_tok_per_s']:9.1f} tok/s, "
            f"observed acceptance {r['acceptance_rate']:.2f}, "
            f"mean length {r['mean_acceptance_length']:.2f}",
            flush=True,
        )
    return rows


def _add_speedups(rows: list[dict], engine: str) -> None:
    """Each row's tok/s over its batch size's run without speculation (same engine)."""
    none = {
        r["batch_size"]: r["output_tok_per_s"]
        for r in rows
        if r["speculation"] is Speculation.NONE and r["engine"] == engine
    }
    for r in rows:
        if r["engine"] == engine:
            r["speedup_vs_none"] = r["output_tok_per_s"] / none[r["batch_size"]]


# ------------------------------------------------------------------- ngram
def ngram_config(args, k: int) -> dict[str, Any]:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }


def run_ngram_engine(family: EngineFamily, args, work) -> list[dict]:
    """One engine family (pdserve or vLLM): none, then each k, every batch size."""
    rows, references = [], {}
    for k in [None, *args.num_speculative_tokens]:
        llm = family.open(None if k is None else ngram_config(args, k))
        for batch in args.batch_sizes:
            reqs = work[: prompts_for(batch, args.min_prompts)]
            prompts, lens = [r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs]
            warm_up(family.generate(llm), prompts, lens, batch)
            before = family.stats(llm) if k is not None else None
            outs, elapsed = timed_groups(family.generate(llm), prompts, lens, batch)
            extra: dict[str, Any] = {
                "speculation": Speculation.NONE if k is None else Speculation.NGRAM
            }
            if k is None:
                references[batch] = outs
            else:
                extra |= {"num_speculative_tokens": k, **acceptance(before, family.stats(llm))}
                extra["outputs_equal_none"] = same_share(outs, references[batch])
            rows.append(rate_row(family.name, batch, outs, elapsed, **extra))
            tok_s = rows[-1]["output_tok_per_s"]
            print(f"{family.name} batch {batch:>3} k={k}: {tok_s:9.1f} tok/s", flush=True)
        family.close(llm)
        del llm  # before the next engine sizes its cache
        free_memory()
    _add_speedups(rows, family.name)
    return rows


def run_ngram(args) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from benchmarks.support.edit_workload import digest, edit_requests

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    num = max(prompts_for(b, args.min_prompts) for b in args.batch_sizes)
    work = edit_requests(tokenizer, num, args.seed)
    pdserve = EngineFamily(
        "pdserve",
        lambda spec: open_pdserve(args.model, args, False, spec),
        pdserve_generate,
        spec_stats,
        lambda llm: None,
    )
    results: dict[str, Any] = {
        "workload_digest": digest(work),
        "rows": run_ngram_engine(pdserve, args, work),
    }
    if args.peer == "vllm":
        from benchmarks.peers import vllm_ngram

        results["rows"] += run_ngram_engine(vllm_family(args), args, work)
        results["vllm_version"] = vllm_ngram.vllm_version()
    return results


def vllm_family(args) -> EngineFamily:
    """vLLM's engine, driven as pdserve's is (benchmarks/peers/vllm_ngram.py)."""
    from benchmarks.peers import vllm_ngram

    sampling: dict[str, Any] = {}  # vLLM's SamplingParams, imported with the engine

    def open_engine(spec: dict | None):
        llm, sampling["cls"] = vllm_ngram.open_vllm(args.model, args, spec)
        return llm

    def generate_of(llm) -> Generate:
        def generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
            cls = sampling["cls"]
            params = [cls(temperature=0.0, max_tokens=n, detokenize=False) for n in max_tokens]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        return generate

    def stats_of(llm) -> argparse.Namespace:
        return argparse.Namespace(**vllm_ngram.spec_counters(llm.get_metrics()))

    return EngineFamily("vllm", open_engine, generate_of, stats_of, vllm_ngram.close_vllm)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    resolve_defaults(args, on_gpu)
    if args.part is Part.NGRAM:
        return save_run("spec_decode", args, run_ngram(args), argv)
    with tempfile.TemporaryDirectory() as tmp:
        target = write_shape_dir(args.shape, Path(tmp) / "target")
        draft = write_shape_dir(args.draft_shape, Path(tmp) / "draft")
        vocab = SHAPES[args.shape]["vocab_size"]
        print(f"target {args.shape}, draft {args.draft_shape}, input {args.input_len}, "
              f"output {args.output_len} tokens", flush=True)  # fmt: skip
        results = run_mechanics(args, target, draft, vocab)
    return save_run("spec_decode", args, results, argv)


if __name__ == "__main__":
    main()
