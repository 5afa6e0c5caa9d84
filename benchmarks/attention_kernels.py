"""Paged attention kernels: our Triton kernels against FlashAttention-4, and both
against the physical limits measured in the same run.

    python benchmarks/attention_kernels.py            # decode and prefill sweeps
    python benchmarks/attention_kernels.py --splits   # batch 1..16: split counts before/after
    python benchmarks/attention_kernels.py --mixed --skip-decode --skip-prefill  # mixed steps

Decode: one query token per sequence, 32 query / 8 KV heads x 128 (Llama-3.1-8B's
attention), over batch, context and page size; the figure of merit is KV bytes
read per second against the device-to-device copy rate. Prefill: 8 prompts of
2048 tokens, causal, the same heads; TFLOP/s against the bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (
    cuda_time_ms,
    measure_copy_bandwidth,
    measure_matmul_flops,
    save_run,
)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def make_cache(torch, batch, ctx, page, kv_heads=KV_HEADS):
    """Random bf16 K/V pages and a shuffled block table for `batch` sequences of `ctx` tokens."""
    pages_per_seq = -(-ctx // page)
    num_pages = batch * pages_per_seq
    k = torch.randn(num_pages, page, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    perm = torch.randperm(num_pages, device="cuda")[: batch * pages_per_seq]
    tables = perm.view(batch, pages_per_seq).to(torch.int32).contiguous()
    return k, v, tables


def fa4():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def bench_decode(torch, copy_bw, batches, contexts, pages) -> list[dict[str, Any]]:
    from engine.layers.attention import triton_decode as td

    fa = fa4()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for page in pages:
        for ctx in contexts:
            for batch in batches:
                k, v, tables = make_cache(torch, batch, ctx, page)
                q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                out = torch.empty_like(q)
                splits = td.decode_num_splits(batch, KV_HEADS, ctx, sms)
                kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
                t_triton = cuda_time_ms(
                    lambda: td.decode_attention(q, k, v, out, tables, lens, HEAD_DIM**-0.5, splits)
                )
                row = {
                    "page": page,
                    "context": ctx,
                    "batch": batch,
                    "kv_bytes": kv_bytes,
                    "triton_ms": t_triton,
                    "triton_splits": splits,
                    "triton_TBps": kv_bytes / t_triton / 1e9,
                }
                if fa is not None:
                    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                    t_fa = cuda_time_ms(
                        lambda: fa(
                            q,
                            k,
                            v,
                            cu_seqlens_q=qsl,
                            seqused_k=lens,
                            page_table=tables,
                            max_seqlen_q=1,
                            softmax_scale=HEAD_DIM**-0.5,
                            causal=True,
                        )
                    )
                    row.update(
                        fa4_ms=t_fa, fa4_TBps=kv_bytes / t_fa / 1e9, triton_vs_fa4=t_fa / t_triton
                    )
                row["triton_vs_copy"] = kv_bytes / (t_triton / 1e3) / (copy_bw / 2)
                rows.append(row)
                print(
                    f"decode page {page:3d} ctx {ctx:5d} batch {batch:3d}: triton {t_triton:.3f} ms "
                    f"({row['triton_TBps']:.2f} TB/s)"
                    + (
                        f", FA4 {row['fa4_ms']:.3f} ms ({row['fa4_TBps']:.2f} TB/s), triton/FA4 speed "
                        f"{row['triton_vs_fa4']:.2f}"
                        if fa is not None
                        else ""
                    ),
                    flush=True,
                )
                torch.cuda.empty_cache()
    return rows


def bench_splits(torch, batches, contexts, max_lens, layers=28) -> list[dict[str, Any]]:
    """Batch 1..16 decode with the split count a CUDA graph fixes for max_model_len:
    the rule before (splits of at least 256 keys) against MIN_SPLIT_KEYS, Qwen3-0.6B's
    heads (16 query, 8 KV). Timed as a decode step runs it: ``layers`` calls back to
    back in one CUDA graph, each on its own KV cache (no L2 reuse)."""
    import triton

    from engine.layers.attention import triton_decode as td
    from engine.layers.skinny_gemm_plan import time_graph_us

    heads, kv_heads = 16, 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for max_len in max_lens:
        for ctx in (c for c in contexts if c < max_len):
            for batch in batches:
                caches = [make_cache(torch, batch, ctx, 16, kv_heads) for _ in range(layers)]
                q = torch.randn(batch, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                out = torch.empty_like(q)
                want = triton.cdiv(2 * sms, batch * kv_heads)
                old = int(max(1, min(want, triton.cdiv(max_len, 256), 64)))
                new = td.decode_num_splits(batch, kv_heads, max_len, sms)
                times = {}
                for name, splits in (("before", old), ("after", new)):
                    calls = [
                        lambda k=k, v=v, t=t, s=splits: td.decode_attention(
                            q, k, v, out, t, lens, HEAD_DIM**-0.5, s
                        )
                        for k, v, t in caches
                    ]
                    times[name] = time_graph_us(calls)
                row = {
                    "max_model_len": max_len,
                    "context": ctx,
                    "batch": batch,
                    "splits_before": old,
                    "splits_after": new,
                    "us_before": times["before"],
                    "us_after": times["after"],
                }
                rows.append(row)
                print(
                    f"decode splits, max_model_len {max_len:5d} ctx {ctx:5d} batch {batch:2d}: "
                    f"{old:2d} splits {times['before']:6.2f} us -> {new:2d} splits "
                    f"{times['after']:6.2f} us per layer ({times['before'] / times['after']:.2f}x)",
                    flush=True,
                )
                del caches
                torch.cuda.empty_cache()
    return rows


def bench_prefill(torch, peak_flops, pages, seqs=8, seq_len=2048) -> list[dict[str, Any]]:
    from engine.layers.attention import triton_kernels as tk

    fa = fa4()
    rows = []
    for page in pages:
        k, v, tables = make_cache(torch, seqs, seq_len, page)
        q = torch.randn(seqs * seq_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        qsl = torch.arange(0, (seqs + 1) * seq_len, seq_len, dtype=torch.int32, device="cuda")
        lens = torch.full((seqs,), seq_len, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        # Causal attention: QK^T and PV over half the (query, key) pairs.
        flops = seqs * 4 * HEADS * HEAD_DIM * seq_len * seq_len / 2
        t_triton = cuda_time_ms(
            lambda: tk.prefill_attention(q, k, v, out, tables, qsl, lens, seq_len, HEAD_DIM**-0.5)
        )
        row = {
            "page": page,
            "seqs": seqs,
            "seq_len": seq_len,
            "flops": flops,
            "triton_ms": t_triton,
            "triton_TFLOPs": flops / t_triton / 1e9,
        }
        if fa is not None:
            t_fa = cuda_time_ms(
                lambda: fa(
                    q,
                    k,
                    v,
                    cu_seqlens_q=qsl,
                    seqused_k=lens,
                    page_table=tables,
                    max_seqlen_q=seq_len,
                    softmax_scale=HEAD_DIM**-0.5,
                    causal=True,
                )
            )
            row.update(fa4_ms=t_fa, fa4_TFLOPs=flops / t_fa / 1e9, triton_vs_fa4=t_fa / t_triton)
        row["triton_vs_matmul_peak"] = row["triton_TFLOPs"] * 1e12 / peak_flops
        rows.append(row)
        print(
            f"prefill page {page:3d} {seqs}x{seq_len}: triton {t_triton:.3f} ms ({row['triton_TFLOPs']:.0f} TFLOP/s)"
            + (
                f", FA4 {row['fa4_ms']:.3f} ms ({row['fa4_TFLOPs']:.0f} TFLOP/s), triton/FA4 speed "
                f"{row['triton_vs_fa4']:.2f}"
                if fa is not None
                else ""
            ),
            flush=True,
        )
        torch.cuda.empty_cache()
    return rows


def bench_mixed(torch, decodes, ctx, q_len, prefix, page=16) -> list[dict[str, Any]]:
    """A serving step: ``decodes`` running sequences at ``ctx`` tokens plus one prompt of
    ``q_len`` new tokens over a cached ``prefix``. One prefill-kernel launch over every
    row (what a mixed step did before) against the decode kernel on the decode rows and
    the prefill kernel on the prompt (the triton backend's split)."""
    from engine.layers.attention import triton_decode as td
    from engine.layers.attention import triton_kernels as tk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for d in decodes:
        k, v, tables = make_cache(torch, d + 1, max(ctx, prefix + q_len), page)
        q_lens = [1] * d + [q_len]
        seq_lens = [ctx] * d + [prefix + q_len]
        q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda")
        qsl = qsl.to(torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        scale = HEAD_DIM**-0.5
        splits = td.decode_num_splits(d, KV_HEADS, max(seq_lens), sms)

        def one_launch():
            tk.prefill_attention(q, k, v, out, tables, qsl, lens, q_len, scale)

        def split():
            td.decode_attention(q[:d], k, v, out[:d], tables[:d], lens[:d], scale, splits)
            tk.prefill_attention(
                q[d:], k, v, out[d:], tables[d:], qsl[d:] - d, lens[d:], q_len, scale
            )

        t_one, t_split = cuda_time_ms(one_launch), cuda_time_ms(split)
        row = {
            "decodes": d,
            "context": ctx,
            "prompt_tokens": q_len,
            "prefix": prefix,
            "one_launch_ms": t_one,
            "split_ms": t_split,
            "speedup": t_one / t_split,
        }
        rows.append(row)
        print(
            f"mixed {d:3d} decodes at {ctx} + {q_len} new over {prefix}: one prefill launch "
            f"{t_one:.3f} ms, decode + prefill kernels {t_split:.3f} ms ({row['speedup']:.2f}x)",
            flush=True,
        )
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--pages", default="16,64,256")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument(
        "--splits",
        action="store_true",
        help="only the batch-1..16 split comparison (Qwen3-0.6B heads, graph split counts)",
    )
    p.add_argument("--max-model-lens", default="1040,40960", help="--splits: graph plans")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument(
        "--mixed",
        action="store_true",
        help="a mixed serving step (decodes + one 128-token prompt over a 2048-token prefix)",
    )
    p.add_argument("--mixed-decodes", default="8,32,128")
    p.add_argument("--out-dir", type=Path)
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    if args.splits:
        rows = bench_splits(torch, [1, 2, 4, 8, 16], [128, 1024, 4096], ints(args.max_model_lens))
        return save_run("attention_kernels", args, {"splits": rows}, argv)
    copy_bw = measure_copy_bandwidth()
    peak = measure_matmul_flops()
    print(
        f"device copy {copy_bw / 1e12:.2f} TB/s (read + write); bf16 matmul {peak / 1e12:.0f} TFLOP/s"
    )
    results: dict[str, Any] = {
        "copy_bytes_per_s": copy_bw,
        "matmul_flops_per_s": peak,
        "fa4_available": fa4() is not None,
    }
    if not args.skip_decode:
        results["decode"] = bench_decode(
            torch, copy_bw, ints(args.batches), ints(args.contexts), ints(args.pages)
        )
    if not args.skip_prefill:
        results["prefill"] = bench_prefill(torch, peak, ints(args.pages))
    if args.mixed:
        results["mixed"] = bench_mixed(torch, ints(args.mixed_decodes), 2176, 128, 2048)
    return save_run("attention_kernels", args, results, argv)


if __name__ == "__main__":
    main()
