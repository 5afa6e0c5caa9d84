"""A/B of the Triton prefill-attention kernel on one GPU, at a mixed step's shapes
(Llama-3.1-8B attention: 32 query heads, 8 KV heads of 128; 16-token pages).

What chose f75d30d (docs/performance.md, "Prefill attention and same-step prefix
sharing"): ``prefill_old`` is the engine's ``_prefill_kernel`` of the tree it runs
in -- run it in 0214bdd's tree for the kernel as it was -- and ``_prefill2`` the
variant: the causal mask only on the diagonal key tiles and, with ``lpt``, the
longest query tiles launched first. For each case it times the decode kernel, the
prefill kernel, both in turn (as a mixed step runs them) and both on two streams,
and sweeps the variant's tiles, warps and stages, recording the largest difference
of its output from the engine kernel's (``*_maxdiff``). A diagnostic: every figure is a kernel time between
CUDA events (median of 7 repeats of 64 launches), not a serving or offline run.

    PYTHONPATH=$PWD python benchmarks/prefill_kernel_ab.py   # writes $OUT/mixattn.json
"""

import itertools
import json
import os
import statistics

import torch
import triton
import triton.language as tl

from engine.layers.attention import triton_decode as td
from engine.layers.attention import triton_kernels as tk


@triton.jit
def _prefill2(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LPT: tl.constexpr,
):
    if LPT:
        head = tl.program_id(0)
        seq = tl.program_id(1)
        m_block = tl.num_programs(2) - 1 - tl.program_id(2)
    else:
        m_block = tl.program_id(0)
        head = tl.program_id(1)
        seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = prefix_len + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.44269504
    end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
    # Every row of the tile sees keys 0 .. prefix_len + m_block * BLOCK_M: whole tiles below need no mask.
    full_end = ((prefix_len + m_block * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    bt = block_tables_ptr + seq * stride_bt
    for start_n in range(0, full_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        blocks = tl.load(bt + offs_n // BLOCK_SIZE)
        slots = blocks.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot
        kv_off = slots[:, None] + kv_head * stride_cache_head + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    for start_n in range(full_end, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        slots = blocks.to(tl.int64) * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot
        kv_off = slots[:, None] + kv_head * stride_cache_head + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        causal = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr
        + (q_start + offs_m)[:, None] * stride_o_tok
        + head * stride_o_head
        + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def prefill2(q, kc, vc, out, bt, qsl, sl, max_q, scale, BM, BN, warps, stages, lpt):
    _, H, D = q.shape
    ns = sl.shape[0]
    bs, KH = kc.shape[1], kc.shape[2]
    mb = triton.cdiv(max_q, BM)
    grid = (H, ns, mb) if lpt else (mb, H, ns)
    _prefill2[grid](
        q,
        kc,
        vc,
        out,
        bt,
        qsl,
        sl,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        bt.stride(0),
        GROUP=H // KH,
        BLOCK_SIZE=bs,
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_M=BM,
        BLOCK_N=BN,
        LPT=lpt,
        num_warps=warps,
        num_stages=stages,
    )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("prefill_kernel_ab.py needs a CUDA GPU")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    H, KH, D, BS = 32, 8, 128, 16
    NB = 40000
    kc = torch.randn(NB, BS, KH, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(NB, BS, KH, D, device=dev, dtype=torch.bfloat16)
    scale = D**-0.5

    def case(n_dec, prompts, prefix=0):
        import random

        rng = random.Random(1)
        dec_lens = [rng.randint(1024, 1151) for _ in range(n_dec)]
        seq_lens = dec_lens + [prefix + p for p in prompts]
        qlens = [1] * n_dec + list(prompts)
        maxb = triton.cdiv(max(seq_lens), BS)
        perm = (
            torch.randperm(NB, device=dev)[: len(seq_lens) * maxb].view(len(seq_lens), maxb).int()
        )
        T = sum(qlens)
        q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), device=dev, dtype=torch.int32)
        sl = torch.tensor(seq_lens, device=dev, dtype=torch.int32)
        return dict(q=q, bt=perm, qsl=qsl, sl=sl, d=n_dec, maxq=max(prompts) if prompts else 1, T=T)

    def timeit(fn, iters=64, reps=7):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / iters)
        return statistics.median(ts)

    side = torch.cuda.Stream()
    res = {}
    CASES = {
        "127dec+2x1024": (127, [1024, 1024]),
        "127dec+1x1024": (127, [1024]),
        "64dec+1x1024": (64, [1024]),
        "192dec+3x1024": (192, [1024, 1024, 1024]),
        "96dec+2x1024": (96, [1024, 1024]),
        "0dec+8x1024": (0, [1024] * 8),
        "127dec+1x1024@1024": (127, [1024], 1024),
        "16dec+1x2048": (16, [2048]),
    }
    for name, spec in CASES.items():
        c = case(*spec)
        d = c["d"]
        q = c["q"]
        out = torch.empty_like(q)
        out2 = torch.empty_like(q)
        splits = (
            td.decode_num_splits(
                d,
                KH,
                int(c["sl"][:d].max()) if d else 1,
                torch.cuda.get_device_properties(dev).multi_processor_count,
            )
            if d
            else 0
        )
        bt_d, sl_d = c["bt"][:d], c["sl"][:d]
        bt_p, sl_p = c["bt"][d:], c["sl"][d:]
        qsl_p = c["qsl"][d:] - d

        def dec():
            if d:
                td.decode_attention(q[:d], kc, vc, out[:d], bt_d, sl_d, scale, splits)

        def pre_old(o=out):
            tk.prefill_attention(q[d:], kc, vc, o[d:], bt_p, qsl_p, sl_p, c["maxq"], scale)

        def seq_old():
            dec()
            pre_old()

        def streams(pre):
            def f():
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    dec()
                pre()
                main.wait_stream(side)

            return f

        r = {
            "decode": timeit(dec) if d else 0.0,
            "prefill_old": timeit(pre_old),
            "seq_old": timeit(seq_old),
            "streams_old": timeit(streams(pre_old)),
        }
        pre_old(out)  # reference
        ref = out[d:].clone()
        best = None
        for BM, BN, w, st, lpt in itertools.product(
            (64, 128), (32, 64), (4, 8), (2, 3), (False, True)
        ):
            if BM == 128 and w == 4:
                continue

            def fn(BM=BM, BN=BN, w=w, st=st, lpt=lpt):
                return prefill2(
                    q[d:], kc, vc, out2[d:], bt_p, qsl_p, sl_p, c["maxq"], scale, BM, BN, w, st, lpt
                )

            try:
                t = timeit(fn, iters=32, reps=5)
            except Exception:
                continue
            key = f"p2_{BM}_{BN}_{w}w{st}s{'_lpt' if lpt else ''}"
            r[key] = t
            if best is None or t < best[1]:
                best = (key, t, fn)
            if (BM, BN, w, st) == (64, 32, 4, 2):
                fn()
                r[key + "_maxdiff"] = float((out2[d:] - ref).abs().max())
        r["best_p2"] = best[0]
        best[2]()
        r["best_p2_maxdiff"] = float((out2[d:].float() - ref.float()).abs().max())
        r["streams_best"] = timeit(streams(best[2]))
        r["seq_best"] = timeit(lambda: (dec(), best[2]()))
        res[name] = r
        print(
            name,
            {
                # Differences in full: rounded like the times they read as 0.0.
                k: (v if k.endswith("maxdiff") else round(v, 1) if isinstance(v, float) else v)
                for k, v in r.items()
                if not k.startswith("p2_") or k.endswith("maxdiff")
            },
            flush=True,
        )
        top = sorted(
            ((v, k) for k, v in r.items() if k.startswith("p2_") and not k.endswith("maxdiff"))
        )[:5]
        print("   top prefill2:", [(k, round(v, 1)) for v, k in top], flush=True)
    with open(os.environ.get("OUT", ".") + "/mixattn.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
