"""Offline throughput on the nano-vllm workload, optionally against HF transformers.

N sequences of random token ids, input and output lengths uniform in
[min, max] (seeded), ``ignore_eos`` so every sequence generates exactly its
length, dummy weights of a named shape (or any config.json). Prints output
tokens/s; ``--hf-baseline`` runs HF transformers ``generate`` on the same
prompts in the same run and prints the ratio. A JSON record goes to
benchmarks/results/.

    python benchmarks/offline_throughput.py                      # CPU-sized defaults
    python benchmarks/offline_throughput.py --shape qwen3-0.6b --num-seqs 256 --hf-baseline
    python benchmarks/offline_throughput.py --shape qwen3-0.6b --peer vllm   # vLLM, same run
    python benchmarks/offline_throughput.py --shape llama-3.1-8b --quantization fp8 \
        --kv-cache-dtype fp8 --unquantized-baseline --peer vllm   # FP8, bf16 and vLLM FP8

The numerics options (``--quantization``, ``--kv-cache-dtype``) go to every
engine of the run: pdserve and, with ``--peer vllm``, vLLM (the same names).
``--unquantized-baseline`` runs pdserve a second time on the same workload
with neither (weights and KV cache in the model's dtype), after the quantized
run; each row of the record names its numerics (``dtype``, ``quantization``,
``kv_cache_dtype``: what the cache stores) and its KV pool (blocks, bytes a
block, bytes in all: blocks per GiB are the pool's size at equal memory;
``--kv-cache-memory-bytes`` gives every engine the same pool).

HF's ``generate`` pads a batch to its longest prompt and runs every row to the
batch's longest output; its "useful" rate counts only the tokens the workload
asked for (the same count as ours), its "generated" rate counts every token it
produced.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_numerics_args, save_run
from benchmarks.offline_lora import parse_counts
from engine.kv_cache_dtype import KVCacheDType
from engine.models.shapes import SHAPES, write_shape_dir

GPU_DEFAULTS = dict(shape="qwen3-0.6b", num_seqs=256, min_len=100, max_len=1024)
CPU_DEFAULTS = dict(shape="smollm2-135m", num_seqs=8, min_len=16, max_len=96)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), help="named model shape (dummy weights)")
    src.add_argument("--config", help="a config.json to build a dummy-weight model from")
    p.add_argument("--num-seqs", type=int)
    p.add_argument("--min-input-len", type=int)
    p.add_argument("--max-input-len", type=int)
    p.add_argument("--min-output-len", type=int)
    p.add_argument("--max-output-len", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    add_numerics_args(p)
    p.add_argument(
        "--unquantized-baseline",
        action="store_true",
        help="also run pdserve with weights and KV cache in the model's dtype on the same "
        "workload (needs --quantization or an FP8 --kv-cache-dtype)",
    )
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--gemv-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--num-kvcache-blocks", type=int, default=-1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="the KV pool's bytes, every engine of the run alike (default: what "
        "--gpu-memory-utilization leaves)",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-fused-ops", action="store_true", help="plain torch RMSNorm/SiLU/RoPE")
    p.add_argument(
        "--piecewise-cuda-graphs",
        action="store_true",
        help="steps with prefill rows through piecewise CUDA graphs (engine/piecewise_graphs.py)",
    )
    p.add_argument("--hf-baseline", action="store_true", help="also run HF transformers generate")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument(
        "--peer",
        choices=["vllm"],
        help="also run this engine on the same workload after pdserve (one JSON record)",
    )
    p.add_argument(
        "--loras",
        type=parse_counts,
        help="also run the workload under N random LoRA adapters mixed uniformly, for each N "
        "of this list (1,8,32), and measure loading one (benchmarks/offline_lora.py)",
    )
    p.add_argument("--max-lora-rank", type=int, default=16, help="the adapters' rank (--loras)")
    p.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off"],
        default="auto",
        help="pdserve's async scheduling (auto: on for CUDA)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after each engine's timed run, run a second workload (seed + 1, so no prefix "
        "hits) under torch.profiler: device kernels by kind (benchmarks/kernel_profile.py)",
    )
    p.add_argument(
        "--out-dir", type=Path, help="where the JSON record goes (default benchmarks/results)"
    )
    return p.parse_args(argv)


def resolve_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
    d = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    if args.shape is None and args.config is None:
        args.shape = d["shape"]
    args.num_seqs = args.num_seqs or d["num_seqs"]
    for name in ("input", "output"):
        if getattr(args, f"min_{name}_len") is None:
            setattr(args, f"min_{name}_len", d["min_len"])
        if getattr(args, f"max_{name}_len") is None:
            setattr(args, f"max_{name}_len", d["max_len"])


def make_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts, outputs = [], []
    for _ in range(args.num_seqs):
        n_in = rng.randint(args.min_input_len, args.max_input_len)
        prompts.append([rng.randrange(min(10000, vocab_size)) for _ in range(n_in)])
        outputs.append(rng.randint(args.min_output_len, args.max_output_len))
    return prompts, outputs


def make_llm(model_dir: Path, args, **extra: Any):
    """pdserve's engine for ``args`` (``extra``: more engine options, e.g. LoRA's)."""
    from engine import LLM

    return LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend,
        gemv_backend=args.gemv_backend,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kvcache_blocks=args.num_kvcache_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enforce_eager=args.enforce_eager,
        fused_ops=not args.no_fused_ops,
        piecewise_cuda_graphs=args.piecewise_cuda_graphs,
        seed=args.seed,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        **extra,
    )


def run_pdserve(model_dir: Path, args, prompts, out_lens, profile_work=None) -> dict[str, Any]:
    from engine import SamplingParams

    llm = make_llm(model_dir, args)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up

    def params_for(lens: list[int]) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
            for n in lens
        ]

    params = params_for(out_lens)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != sum(out_lens):
        raise RuntimeError(f"pdserve produced {produced} tokens, expected {sum(out_lens)}")
    runner = llm.llm_engine.model_runner
    stats = llm.llm_engine.stats()
    profiled = None
    if profile_work is not None:
        p_prompts, p_lens = profile_work
        p_params = params_for(p_lens)
        from benchmarks.kernel_profile import profile_kernels

        _, profiled = profile_kernels(lambda: llm.generate(p_prompts, p_params, use_tqdm=False))
    return {
        "profile": profiled,
        "output_tokens": produced,
        "elapsed_s": elapsed,
        "output_tok_per_s": produced / elapsed,
        "total_tok_per_s": (produced + sum(map(len, prompts))) / elapsed,
        "attention_backend": runner.attention_backend.name.value,
        "gemv_backend": args.gemv_backend,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "quantization": args.quantization,
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "device": str(runner.device),
        "num_kvcache_blocks": runner.num_kvcache_blocks,
        "kv_block_bytes": runner.kv_block_bytes,
        "kv_cache_bytes": runner.num_kvcache_blocks * runner.kv_block_bytes,
        "num_preemptions": stats.num_preemptions,
        "async_scheduling": llm.llm_engine.async_scheduling,
    }


def run_hf(model_dir: Path, args, prompts, out_lens, device: str, dtype) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: run every row to its length
    model.generation_config.pad_token_id = 0
    bs = args.hf_batch_size

    def batches():
        for i in range(0, len(prompts), bs):
            yield prompts[i : i + bs], out_lens[i : i + bs]

    def run_batch(batch, lens):
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(lens),
            do_sample=False,
            top_p=None,
            top_k=None,
        )
        return out.shape[1] - width

    with torch.inference_mode():
        run_batch([[1, 2, 3, 4]], [4])  # warm-up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        generated = 0
        for batch, lens in batches():
            new = run_batch(batch, lens)
            generated += new * len(batch)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    useful = sum(out_lens)
    return {
        "batch_size": bs,
        "useful_output_tokens": useful,
        "generated_tokens": generated,
        "elapsed_s": elapsed,
        "output_tok_per_s": useful / elapsed,
        "generated_tok_per_s": generated / elapsed,
    }


def free_device_memory() -> None:
    """Give a finished engine's memory back before the next one sizes its cache."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_unquantized(model_dir: Path, args, prompts, out_lens, ours: dict[str, Any]) -> dict:
    """``--unquantized-baseline``: pdserve again, weights and KV cache in the
    model's dtype; its row and the quantized run's ratio over it."""
    free_device_memory()
    plain = argparse.Namespace(
        **{**vars(args), "quantization": None, "kv_cache_dtype": KVCacheDType.AUTO.value}
    )
    base = run_pdserve(model_dir, plain, prompts, out_lens)
    ratio = ours["output_tok_per_s"] / base["output_tok_per_s"]
    blocks = ours["num_kvcache_blocks"] / base["num_kvcache_blocks"]
    per_block = base["kv_block_bytes"] / ours["kv_block_bytes"]
    print(
        f"pdserve unquantized ({base['dtype']} weights and KV): {base['output_tok_per_s']:.1f} "
        f"output tok/s -> the quantized run is {ratio:.2f}x; KV blocks "
        f"{ours['num_kvcache_blocks']} against {base['num_kvcache_blocks']} ({blocks:.2f}x), "
        f"{per_block:.2f}x at equal memory",
        flush=True,
    )
    return {
        "pdserve_unquantized": base,
        "ratio_vs_unquantized": ratio,
        "kv_blocks_at_equal_memory_vs_unquantized": per_block,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    args = parse_args(argv)
    if args.unquantized_baseline and not (
        args.quantization or KVCacheDType(args.kv_cache_dtype).is_fp8
    ):
        raise SystemExit(
            "--unquantized-baseline compares against a quantized run: add --quantization fp8 "
            "and/or --kv-cache-dtype fp8"
        )
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    resolve_defaults(args, on_gpu)
    if args.profile and not on_gpu:
        raise SystemExit("--profile traces CUDA kernels: it needs a GPU (--device cuda)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.config:
            model_dir = Path(tmp)
            (model_dir / "config.json").write_text(Path(args.config).read_text())
            shape = Path(args.config).name
        else:
            model_dir = write_shape_dir(args.shape, tmp)
            shape = args.shape
        from engine.models.config import ModelArchConfig

        arch = ModelArchConfig.from_dir(model_dir)
        prompts, out_lens = make_workload(args, arch.vocab_size)
        print(
            f"workload: {args.num_seqs} sequences, input {args.min_input_len}-{args.max_input_len}, "
            f"output {args.min_output_len}-{args.max_output_len} tokens, shape {shape}",
            flush=True,
        )
        profile_work = None
        if args.profile:
            profile_work = make_workload(
                argparse.Namespace(**{**vars(args), "seed": args.seed + 1}), arch.vocab_size
            )
        ours = run_pdserve(model_dir, args, prompts, out_lens, profile_work)
        print(
            f"pdserve ({ours['attention_backend']}, {ours['dtype']}, "
            f"quantization {ours['quantization']}, KV {ours['kv_cache_dtype']}, {ours['device']}): "
            f"{ours['output_tokens']} tokens in {ours['elapsed_s']:.2f} s = "
            f"{ours['output_tok_per_s']:.1f} output tok/s",
            flush=True,
        )
        results: dict[str, Any] = {"pdserve": ours}
        if args.unquantized_baseline:
            results.update(run_unquantized(model_dir, args, prompts, out_lens, ours))
        if args.hf_baseline:
            dtype = getattr(torch, ours["dtype"])
            hf = run_hf(model_dir, args, prompts, out_lens, ours["device"], dtype)
            results["hf_transformers"] = hf
            results["ratio_vs_hf"] = ours["output_tok_per_s"] / hf["output_tok_per_s"]
            print(
                f"HF transformers generate (batch {hf['batch_size']}): {hf['output_tok_per_s']:.1f} "
                f"useful output tok/s ({hf['generated_tok_per_s']:.1f} generated) -> pdserve is "
                f"{results['ratio_vs_hf']:.2f}x",
                flush=True,
            )
        if args.loras:
            from benchmarks.offline_lora import run_loras

            base = ours["output_tok_per_s"]
            results["lora"] = run_loras(model_dir, args, prompts, out_lens, base, Path(tmp))
        if args.peer == "vllm" and not args.loras:  # --loras runs vLLM's LoRA rows instead
            from benchmarks.peers.vllm_peer import run_vllm

            free_device_memory()  # pdserve's engine is gone
            peer = run_vllm(model_dir, args, prompts, out_lens, profile_work)
            results["vllm"] = peer
            results["ratio_vs_vllm"] = ours["output_tok_per_s"] / peer["output_tok_per_s"]
            print(
                f"vLLM {peer['version']}: {peer['output_tok_per_s']:.1f} output tok/s -> pdserve is "
                f"{results['ratio_vs_vllm']:.2f}x",
                flush=True,
            )
        if args.profile:
            from benchmarks.kernel_profile import print_summary

            for name, res in results.items():
                if isinstance(res, dict) and res.get("profile"):
                    print_summary(f"{name}, profiled run", res["profile"])
    return save_run("offline_throughput", args, results, argv)


if __name__ == "__main__":
    main()
