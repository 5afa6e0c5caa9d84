"""Whole-model steps against physical limits measured in the same run.

    python benchmarks/model_step.py decode   # step time vs the HBM-bandwidth floor
    python benchmarks/model_step.py prefill  # 8 x 2048-token prefill MFU

Decode: batch of B sequences with C tokens of context each; one step = forward
(through the CUDA graph when the backend has one) + logits + greedy sampling.
Floor: ``t >= (weight bytes + B * C * KV bytes per token) / copy bandwidth`` with
the device-to-device copy rate (bytes read + written per second) as the
bandwidth. Prefill: one forward over 8 prompts of 2048 tokens; model FLOPs are
2 x (matmul parameters) per token plus causal attention; MFU is against the
bf16 matmul rate. A mixture-of-experts model counts its active parameters: a
step reads the experts its B tokens chose (expected ``1 - (1 - k/E)^B`` of
them, routing uniform as with dummy weights) and a token multiplies by k of E.

    python benchmarks/model_step.py both --shapes qwen3-30b-a3b --prefill-shape qwen3-30b-a3b

``--quantization fp8`` (FP8 weights, quantized at load) and ``--kv-cache-dtype
fp8`` run the steps quantized, and the floor counts the bytes they read: one
a weight plus its row scales (float32), one a KV element.

    python benchmarks/model_step.py decode --quantization fp8 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    add_numerics_args,
    cuda_time_ms,
    measure_copy_bandwidth,
    measure_matmul_flops,
    save_run,
)
from engine.models.shapes import write_shape_dir


def make_runner(
    shape: str,
    tmp: str,
    args,
    max_model_len: int,
    num_blocks: int,
    max_num_seqs: int,
    device: str = "cuda",
):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    model_dir = write_shape_dir(shape, Path(tmp) / shape)
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        device=device,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.backend,
        fused_ops=not args.no_fused_ops,
        enforce_eager=args.enforce_eager,
        gemv_backend=getattr(args, "gemv_backend", "auto"),
        piecewise_cuda_graphs=getattr(args, "piecewise", False),
        max_model_len=max_model_len,
        num_kvcache_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(16384, max_num_seqs),
    )
    return ModelRunner(config, frozenset())


def decode_step(runner, inputs, batch: int):
    """One decode step as the engine runs it: the captured graph when one fits
    (else eager), the logits and greedy sampling."""
    from engine.layers.sampler import SamplingRow
    from engine.sampling_params import SamplingParams

    greedy = [SamplingRow(SamplingParams(temperature=0), [1], 1, None, [])] * batch

    def step():
        if runner.graphs is not None and runner.graphs.can_run(inputs):
            hidden = runner.graphs.run(inputs)
        else:
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        runner.sampler(runner.model.compute_logits(hidden), greedy)

    return step


def expert_fraction(cfg, tokens: int) -> float:
    """The expected share of an MoE layer's experts that ``tokens`` tokens choose
    (uniform routing); 1 for a dense model."""
    if cfg.moe is None:
        return 1.0
    return 1.0 - (1.0 - cfg.moe.top_k / cfg.moe.num_experts) ** tokens


def weight_bytes_read(runner, tokens: int = 1) -> int:
    """Parameter bytes one decode step of ``tokens`` tokens reads (an untied input
    embedding is only gathered; of stacked experts, those the tokens chose), in
    their stored dtype: an FP8 projection's weight and its scales (a buffer)."""
    model = runner.model
    total = 0
    seen = set()
    scales = [(n, b) for n, b in model.named_buffers() if n.endswith("weight_scale")]
    for name, p in [*model.named_parameters(), *scales]:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name == "embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        share = expert_fraction(model.config, tokens) if p.dim() == 3 else 1.0
        total += int(p.numel() * p.element_size() * share)
    return total


def kv_bytes_read(runner, batch: int, context: int) -> int:
    """KV bytes one decode step reads: every layer's K and V of ``batch``
    sequences' ``context`` tokens, in the cache's dtype (1 byte an element FP8)."""
    return batch * context * runner.kv_block_bytes // runner.block_size


def active_matmul_params(runner) -> float:
    """Matmul parameters a token multiplies by: every 2-D projection but the input
    embedding, and top-k of E stacked experts."""
    cfg = runner.config.model_config
    active = cfg.moe.top_k / cfg.moe.num_experts if cfg.moe is not None else 0.0
    return sum(
        p.numel() * (1.0 if p.dim() == 2 else active)
        for n, p in runner.model.named_parameters()
        if p.dim() in (2, 3) and "embed_tokens" not in n
    )


def decode(args, copy_bw) -> list[dict[str, Any]]:
    import gc

    import torch

    rows = []
    for shape in args.shapes.split(","):
        for gemv in args.gemv_backends.split(","):
            shape_args = argparse.Namespace(**{**vars(args), "gemv_backend": gemv})
            with tempfile.TemporaryDirectory() as tmp:
                rows.extend(decode_shape(shape_args, shape, tmp, copy_bw))
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def decode_shape(args, shape: str, tmp: str, copy_bw: float) -> list[dict[str, Any]]:
    import torch

    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    blocks_per_seq = -(-(ctx + 1) // 16)
    runner = make_runner(
        shape, tmp, args, ctx + 16, max(batches) * blocks_per_seq + 1, max(batches)
    )
    cfg = runner.config.model_config
    rows = []
    for batch in batches:
        wbytes = weight_bytes_read(runner, batch)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        # A different token per sequence: an MoE layer then routes them apart,
        # as a real batch is (one token for all would read only its k experts).
        rng = random.Random(batch)
        ids = [[1] * ctx + [rng.randrange(2, cfg.vocab_size)] for _ in range(batch)]
        inputs = runner.build_inputs(ids, [ctx] * batch, [1] * batch, tables)
        step = decode_step(runner, inputs, batch)
        with torch.inference_mode():
            ms = cuda_time_ms(step, warmup=3, iters=20)
        kv_bytes = kv_bytes_read(runner, batch, ctx)
        floor_ms = (wbytes + kv_bytes) / copy_bw * 1e3
        row = {
            "shape": shape,
            "backend": runner.attention_backend.name.value,
            "cuda_graphs": runner.graphs is not None,
            "fused_ops": runner.config.fused_ops,
            "gemv_backend": runner.config.gemv_backend.value,
            "quantization": args.quantization,
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "batch": batch,
            "context": ctx,
            "step_ms": ms,
            "floor_ms": floor_ms,
            "fraction_of_floor": floor_ms / ms,
            "weight_bytes": wbytes,
            "kv_bytes": kv_bytes,
        }
        rows.append(row)
        print(
            f"decode {shape} {row['backend']} fused_ops={row['fused_ops']} "
            f"gemv={row['gemv_backend']} quantization={args.quantization} "
            f"kv={row['kv_cache_dtype']} batch {batch:3d} ctx {ctx}: "
            f"{ms:.3f} ms/step, floor {floor_ms:.3f} ms -> {100 * row['fraction_of_floor']:.0f}% of the HBM floor",
            flush=True,
        )
    return rows


def prefill(args, peak) -> list[dict[str, Any]]:
    import torch

    rows = []
    seqs, seq_len = args.seqs, args.seq_len
    blocks_per_seq = -(-seq_len // 16)
    with tempfile.TemporaryDirectory() as tmp:
        runner = make_runner(
            args.prefill_shape, tmp, args, seq_len + 16, seqs * blocks_per_seq + 1, seqs
        )
        cfg = runner.config.model_config
        matmul_params = active_matmul_params(runner)
        if cfg.tie_word_embeddings:
            matmul_params += cfg.vocab_size * cfg.hidden_size
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(seqs)]
        inputs = runner.build_inputs([[1] * seq_len] * seqs, [0] * seqs, [seq_len] * seqs, tables)
        last = inputs.meta.query_start_loc[1:].long() - 1

        def forward():
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            runner.model.compute_logits(hidden[last])

        with torch.inference_mode():
            ms = cuda_time_ms(forward, warmup=2, iters=10)
        tokens = seqs * seq_len
        # lm_head only runs on the last token of each prompt.
        linear = 2 * (matmul_params - cfg.vocab_size * cfg.hidden_size) * tokens
        linear += 2 * cfg.vocab_size * cfg.hidden_size * seqs
        attention = (
            cfg.num_hidden_layers
            * seqs
            * 4
            * cfg.num_attention_heads
            * cfg.head_dim
            * seq_len**2
            / 2
        )
        flops = linear + attention
        row = {
            "shape": args.prefill_shape,
            "backend": runner.attention_backend.name.value,
            "seqs": seqs,
            "seq_len": seq_len,
            "ms": ms,
            "model_flops": flops,
            "attention_flops": attention,
            "TFLOPs": flops / ms / 1e9,
            "mfu": flops / (ms / 1e3) / peak,
        }
        rows.append(row)
        print(
            f"prefill {args.prefill_shape} {row['backend']} {seqs}x{seq_len}: {ms:.1f} ms, "
            f"{row['TFLOPs']:.0f} TFLOP/s = {100 * row['mfu']:.0f}% MFU",
            flush=True,
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["decode", "prefill", "both"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--no-fused-ops", action="store_true", help="plain torch RMSNorm/SiLU/RoPE")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--gemv-backends",
        default="auto",
        help="decode: one run per gemv_backend in this list (auto, triton, torch)",
    )
    add_numerics_args(p)
    p.add_argument("--shapes", default="qwen3-0.6b,llama-3.1-8b")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-shape", default="llama-3.1-8b")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out-dir", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.what != "decode" and (args.quantization or args.kv_cache_dtype != "auto"):
        raise SystemExit(
            "--quantization and --kv-cache-dtype are for decode: prefill's MFU is against "
            "the bf16 matmul rate"
        )
    results: dict[str, Any] = {}
    if args.what in ("decode", "both"):
        results["copy_bytes_per_s"] = copy_bw = measure_copy_bandwidth()
        print(f"device copy {copy_bw / 1e12:.2f} TB/s (read + write)")
        results["decode"] = decode(args, copy_bw)
    if args.what in ("prefill", "both"):
        results["matmul_flops_per_s"] = peak = measure_matmul_flops()
        print(f"bf16 matmul {peak / 1e12:.0f} TFLOP/s")
        results["prefill"] = prefill(args, peak)
    return save_run("model_step", args, results, argv)


if __name__ == "__main__":
    main()
