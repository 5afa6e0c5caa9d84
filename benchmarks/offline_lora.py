"""``offline_throughput.py --loras 1,8,32``: the same workload under N LoRA adapters.

Rows: one LoRA engine (``enable_lora``, ``max_loras`` and ``max_cpu_loras``
the largest N, ``max_lora_rank``) runs the workload with no adapter (row 0)
and then with N random rank-``--max-lora-rank`` adapters mixed uniformly
(prompt i under adapter i mod N), each row after ``reset_prefix_cache`` so
that no row reuses another's KV. Every adapter is registered (``add_lora``)
and used once by a short greedy probe before the rows, so the timed rows
measure serving the adapters, not reading them; the probe also says how many
adapters change the base model's output. Each row's ratio is against the
plain engine's run of the same workload (``results["pdserve"]``, no LoRA).

The adapter-load cost (``load_cost``), what the router's
``--lora-load-tokens`` prices: reading one adapter from its files (page
cache) and copying one host-resident adapter into a device slot, each in ms
and in prompt tokens, a token being the prefill rate of the same engine on
fresh prompts under an adapter already in its slot (the median of three
batches of 8 prompts of the longest input length).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

PROBE_TOKENS = 8
LOAD_REPEATS = 8
PREFILL_PROMPTS = 8
PREFILL_REPEATS = 3


def parse_counts(text: str) -> list[int]:
    """``1,8,32`` -> [1, 8, 32]: adapter counts, positive and increasing."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--loras takes adapter counts such as 1,8,32; got {text!r}") from None
    if any(c < 1 for c in counts) or counts != sorted(set(counts)):
        raise ValueError(f"--loras takes positive, increasing adapter counts; got {text!r}")
    return counts


def mix(items: list[Any], n_prompts: int) -> list[Any]:
    """Prompt i gets ``items[i % len(items)]``: every adapter equally often,
    and every stretch of the batch mixes them all."""
    return [items[i % len(items)] for i in range(n_prompts)]


def lora_engine_kwargs(args) -> dict[str, Any]:
    """The LoRA options, the same for pdserve's engine and vLLM's (vLLM's names)."""
    most = max(args.loras)
    return {
        "enable_lora": True,
        "max_loras": most,
        "max_cpu_loras": most,
        "max_lora_rank": args.max_lora_rank,
    }


def row(n_adapters: int, produced: int, elapsed: float, base_tok_per_s: float) -> dict[str, Any]:
    rate = produced / elapsed
    return {
        "adapters": n_adapters,
        "output_tokens": produced,
        "elapsed_s": elapsed,
        "output_tok_per_s": rate,
        "ratio_vs_base": rate / base_tok_per_s,
    }


def run_pdserve_loras(
    model_dir: Path, args, prompts, out_lens, adapter_dirs: list[Path], base_tok_per_s: float
) -> dict[str, Any]:
    """The rows and the load cost on one LoRA engine (module docstring)."""
    from benchmarks.offline_throughput import make_llm
    from engine import LoRARequest, SamplingParams

    llm = make_llm(model_dir, args, **lora_engine_kwargs(args))
    requests = [LoRARequest(f"lora-{k}", k + 1, str(d)) for k, d in enumerate(adapter_dirs)]
    for request in requests:
        llm.llm_engine.add_lora(request)
    probe = [prompts[0][:16]] * (len(requests) + 1)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=PROBE_TOKENS)
    outs = llm.generate(probe, greedy, use_tqdm=False, lora_request=[None, *requests])
    base_out, *lora_outs = [o.outputs[0].token_ids for o in outs]
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
        for n in out_lens
    ]
    lora = llm.llm_engine.model_runner.lora
    rows = []
    for n in [0, *args.loras]:
        per_prompt = mix(requests[:n], len(prompts)) if n else None
        llm.reset_prefix_cache()
        loads_before = lora.num_slot_loads
        start = time.perf_counter()
        # As run_pdserve's timed call (its progress bar included), for a like ratio.
        outs = llm.generate(prompts, params, lora_request=per_prompt)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != sum(out_lens):
            raise RuntimeError(f"pdserve produced {produced} tokens, expected {sum(out_lens)}")
        rows.append(row(n, produced, elapsed, base_tok_per_s))
        rows[-1]["slot_loads"] = lora.num_slot_loads - loads_before
        print(_row_line("pdserve", rows[-1]), flush=True)
    return {
        "engine_kwargs": lora_engine_kwargs(args),
        "probe_differs_from_base": [out != base_out for out in lora_outs],
        "rows": rows,
        "load_cost": measure_load_cost(llm, requests, args),
    }


def _row_line(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name} LoRA engine, {r['adapters']} adapters: {r['output_tok_per_s']:.1f} output "
        f"tok/s ({r['ratio_vs_base']:.2f}x the base model alone)"
    )


def measure_load_cost(llm, requests, args) -> dict[str, Any]:
    """Median ms to read an adapter and to copy one into a slot; the prefill
    ms per token; each load in prompt tokens (module docstring)."""
    lora = llm.llm_engine.model_runner.lora
    sync = _synchronizer(lora.device)
    read_ms = []
    for request in (requests * LOAD_REPEATS)[:LOAD_REPEATS]:
        start = time.perf_counter()
        adapter = lora.read(request)
        read_ms.append(1e3 * (time.perf_counter() - start))
    copy_ms = []
    for request in (requests * LOAD_REPEATS)[:LOAD_REPEATS]:
        sync()
        # A slot that says it holds nothing is copied into: the copy each
        # measurement times is the one a request whose adapter is in no slot waits for.
        lora.in_slot[0] = None
        start = time.perf_counter()
        lora.load_slot(0, request)
        sync()
        copy_ms.append(1e3 * (time.perf_counter() - start))
    token_ms_all = _prefill_token_ms(llm, requests[0], args.max_input_len, args.seed, sync)
    token_ms = statistics.median(token_ms_all)
    read, copy = statistics.median(read_ms), statistics.median(copy_ms)
    cost = {
        "adapter_bytes": sum(a.nbytes + b.nbytes for a, b in adapter.weights.values()),
        "read_ms": read,
        "slot_copy_ms": copy,
        "read_ms_all": read_ms,
        "slot_copy_ms_all": copy_ms,
        "prefill_prompts": PREFILL_PROMPTS,
        "prefill_prompt_tokens": args.max_input_len,
        "prefill_token_ms": token_ms,
        "prefill_token_ms_all": token_ms_all,
        "slot_copy_tokens": copy / token_ms,
        "read_and_copy_tokens": (read + copy) / token_ms,
    }
    print(
        f"adapter load: read {read:.2f} ms, slot copy {copy:.2f} ms; a prefill token "
        f"{token_ms * 1e3:.2f} us -> {cost['slot_copy_tokens']:.0f} tokens from host memory, "
        f"{cost['read_and_copy_tokens']:.0f} from its files",
        flush=True,
    )
    return cost


def _prefill_token_ms(llm, request, length: int, seed: int, sync) -> list[float]:
    """ms per prompt token of prefilling PREFILL_PROMPTS fresh prompts of
    ``length`` tokens under ``request``'s adapter (in its slot), each of
    PREFILL_REPEATS times on new prompts (none in the prefix cache)."""
    from engine import SamplingParams

    rng = random.Random(seed + 2)
    vocab = min(10000, llm.llm_engine.config.model_config.vocab_size)
    one = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    # The adapter into its slot first, so that no timed prefill copies it.
    llm.generate([[1, 2, 3, 4]], one, use_tqdm=False, lora_request=request)
    times = []
    for _ in range(PREFILL_REPEATS):
        fresh = [[rng.randrange(vocab) for _ in range(length)] for _ in range(PREFILL_PROMPTS)]
        sync()
        start = time.perf_counter()
        llm.generate(fresh, one, use_tqdm=False, lora_request=request)
        sync()
        times.append(1e3 * (time.perf_counter() - start) / (length * PREFILL_PROMPTS))
    return times


def _synchronizer(device):
    import torch

    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def run_loras(model_dir: Path, args, prompts, out_lens, base_tok_per_s: float, tmp: Path):
    """``--loras``: make the adapters, run pdserve's rows and, with ``--peer
    vllm``, vLLM's on the same adapters (its rows against its own row 0)."""
    import gc

    import torch

    from benchmarks.support.lora_adapters import make_random_adapters

    start = time.perf_counter()
    dirs = make_random_adapters(model_dir, tmp / "adapters", max(args.loras), args.max_lora_rank)
    print(f"{len(dirs)} adapters made in {time.perf_counter() - start:.1f} s", flush=True)
    gc.collect()  # the plain engine's memory back before the LoRA engine sizes its cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result = {
        "pdserve": run_pdserve_loras(model_dir, args, prompts, out_lens, dirs, base_tok_per_s)
    }
    if args.peer == "vllm":
        from benchmarks.peers.vllm_lora import run_vllm_loras

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result["vllm"] = peer = run_vllm_loras(model_dir, args, prompts, out_lens, dirs)
        for ours, theirs in zip(result["pdserve"]["rows"], peer["rows"], strict=True):
            ours["ratio_vs_vllm"] = ours["output_tok_per_s"] / theirs["output_tok_per_s"]
            print(f"{ours['adapters']} adapters: pdserve {ours['ratio_vs_vllm']:.2f}x vLLM")
    return result
