"""Our Triton kernels compiled for Hopper (sm_90) without a GPU.

The interpreter runs kernels as numpy code, so it cannot catch what only the
compiler rejects (a constexpr mixed with a tensor in a condition, a layout
that does not lower, an early return it cannot structure). Compiling to a
cubin here does; the GPU host still runs them (tests/gpu). The compiler runs
in a child process: this one has the interpreter on (tests/conftest.py).

    python -m tests.kernels.test_compile_hopper   # the child: compile, report
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

try:
    import triton
    from triton.backends.compiler import GPUTarget

    HOPPER = GPUTarget("cuda", 90, 32)
except ImportError:  # pragma: no cover - no triton, or no CUDA backend in it
    triton = HOPPER = None


def compile_for_hopper(fn, signature: dict, constexprs: dict, num_warps=4, num_stages=3):
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    # Pointers and sizes 16-byte aligned / divisible by 16, as the JIT specialises them.
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, kind in enumerate(signature.values())
        if kind.startswith("*") or kind == "i32"
    }
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=aligned)
    return triton.compile(
        src, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages}
    )


GEMM = dict.fromkeys(["x_ptr", "w_ptr", "b_ptr", "out_ptr"], "*bf16") | {"part_ptr": "*fp32"}
GEMM |= dict.fromkeys(["M", "N", "K", "stride_xm", "stride_wn", "stride_om"], "i32")


SKINNY_CASES = [
    (1, 8, 1024, 1, False, True, False),  # batch 1: the FMA tile with its prefetch
    (4, 16, 256, 2, False, False, True),
    (16, 32, 128, 4, True, True, False),  # the tensor-core tile, split K
]


def compile_skinny_gemm(block_m, block_n, block_k, split_k, use_dot, even_k, bias):
    from engine.layers import skinny_gemm_kernels as sk

    const = dict(HAS_BIAS=bias, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    const |= dict(SPLIT_K=split_k, USE_DOT=use_dot, EVEN_K=even_k)
    kernel = compile_for_hopper(sk._skinny_gemm_kernel, GEMM, const)
    pipelined = "async_copy" in kernel.asm["ttgir"]
    reduce = dict.fromkeys(["part_ptr", "b_ptr", "out_ptr"], "*fp32")
    reduce |= dict.fromkeys(["M", "N", "stride_om"], "i32")
    compile_for_hopper(
        sk._split_k_reduce_kernel, reduce, dict(HAS_BIAS=bias, SPLIT_K=split_k, BLOCK=1024)
    )
    return pipelined


def compile_rope_qk(has_norm, store_kv):
    from engine.layers import fused_kernels as fk

    sig = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr"], "*bf16") | {"pos_ptr": "*i64"}
    sig |= dict.fromkeys(["cos_ptr", "sin_ptr"], "*fp32")
    sig |= dict.fromkeys(["q_norm_ptr", "k_norm_ptr", "k_cache_ptr", "v_cache_ptr"], "*bf16")
    sig |= {"slot_ptr": "*i64"}
    strides = ["stride_q_tok", "stride_q_head", "stride_k_tok", "stride_k_head"]
    strides += ["stride_v_tok", "stride_v_head", "stride_cache_slot", "stride_cache_head"]
    sig |= dict.fromkeys(strides, "i32") | {"eps": "fp32"}
    const = dict(NUM_Q_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, HB=8)
    const |= dict(HAS_NORM=has_norm, STORE_KV=store_kv)
    compile_for_hopper(fk._rope_qk_kernel, sig, const, num_warps=4)


def kv_cache_sig(fp8: bool) -> dict:
    """The cache pointers and their scales' (an FP8 cache: e4m3, read with its scales)."""
    cache = "*fp8e4nv" if fp8 else "*bf16"
    return dict.fromkeys(["k_cache_ptr", "v_cache_ptr"], cache) | {"kv_scales_ptr": "*fp32"}


def compile_decode_attention(num_splits, sliding=False, softcap=False, fp8=False):
    from engine.layers.attention import triton_decode as td

    sig = {"q_ptr": "*bf16"} | kv_cache_sig(fp8)
    sig |= dict.fromkeys(["block_tables_ptr", "seq_lens_ptr"], "*i32")
    sig |= dict.fromkeys(["part_out_ptr", "part_lse_ptr"], "*fp32") | {"out_ptr": "*bf16"}
    sig |= {"scale": "fp32", "softcap": "fp32", "window": "i32"}
    strides = ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head"]
    strides += ["stride_cache_block", "stride_cache_slot", "stride_cache_head", "stride_bt"]
    sig |= dict.fromkeys(strides, "i32") | {"num_splits": "i32"}
    const = dict(ONE_SPLIT=num_splits == 1, GROUP=2, BLOCK_G=16, BLOCK_SIZE=16, HEAD_DIM=128)
    const |= dict(BLOCK_D=128, BLOCK_N=64, SLIDING=sliding, HAS_SOFTCAP=softcap, KV_FP8=fp8)
    compile_for_hopper(td._decode_split_kernel, sig, const, num_stages=4)
    if num_splits > 1:
        red = dict.fromkeys(["part_out_ptr", "part_lse_ptr"], "*fp32") | {"seq_lens_ptr": "*i32"}
        red |= {"out_ptr": "*bf16", "stride_o_tok": "i32", "stride_o_head": "i32"}
        red |= {"num_splits": "i32", "window": "i32"}
        const = dict(BLOCK_S=64, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, SLIDING=sliding)
        compile_for_hopper(td._decode_reduce_kernel, red, const)


def compile_prefill_attention(sliding, softcap, fp8=False):
    from engine.layers.attention import triton_kernels as tk

    sig = {"q_ptr": "*bf16"} | kv_cache_sig(fp8) | {"out_ptr": "*bf16"}
    sig |= dict.fromkeys(["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"], "*i32")
    sig |= {"scale": "fp32", "softcap": "fp32", "window": "i32"}
    strides = ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head"]
    strides += ["stride_cache_block", "stride_cache_slot", "stride_cache_head", "stride_bt"]
    sig |= dict.fromkeys(strides, "i32")
    const = dict(GROUP=4, BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=32)
    const |= dict(SLIDING=sliding, HAS_SOFTCAP=softcap, KV_FP8=fp8)
    compile_for_hopper(tk._prefill_kernel, sig, const, num_stages=2)


def compile_store_kv(fp8):
    from engine.layers.attention import triton_kernels as tk

    sig = dict.fromkeys(["k_ptr", "v_ptr"], "*bf16") | {
        "k_cache_ptr": "*fp8e4nv" if fp8 else "*bf16",
        "v_cache_ptr": "*fp8e4nv" if fp8 else "*bf16",
        "slot_ptr": "*i64",
        "kv_scales_ptr": "*fp32",
    }
    sig |= dict.fromkeys(["stride_k_tok", "stride_v_tok", "stride_cache_slot"], "i32")
    compile_for_hopper(tk._store_kv_kernel, sig, dict(ROW=1024, BLOCK=1024, KV_FP8=fp8))


def compile_fused_moe(per_pair, even_k, config):
    from engine.layers.moe import fused_moe as fm

    sig = dict.fromkeys(["a_ptr", "b_ptr", "c_ptr"], "*bf16") | {"topk_weights_ptr": "*fp32"}
    sig |= dict.fromkeys(["sorted_ids_ptr", "expert_ids_ptr", "num_padded_ptr"], "*i32")
    sig |= dict.fromkeys(["N", "K", "num_pairs", "stride_am", "stride_be", "stride_bn"], "i32")
    sig |= dict.fromkeys(["stride_bk", "stride_cm"], "i32")
    block_m, block_n, block_k, group_m, warps, stages = config
    const = dict(top_k=8, A_PER_PAIR=per_pair, MUL_ROUTED_WEIGHT=per_pair, EVEN_K=even_k)
    const |= dict(IEEE=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m)
    kernel = compile_for_hopper(fm._fused_moe_kernel, sig, const, warps, stages)
    return "async_copy" in kernel.asm["ttgir"]


def compile_moe_dispatch(top_k, block_e, renormalize):
    from engine.layers.moe import dispatch as md

    topk = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32"}
    topk |= {"num_experts": "i32", "stride_l": "i32"}
    const = dict(TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=8)
    compile_for_hopper(md._topk_kernel, topk, const)
    count = {"ids_ptr": "*i32", "counts_ptr": "*i32", "num_pairs": "i32", "num_experts": "i32"}
    compile_for_hopper(md._count_kernel, count, dict(BLOCK=1024))
    runs = dict.fromkeys(["counts_ptr", "cursors_ptr", "expert_ids_ptr", "num_padded_ptr"], "*i32")
    runs |= {"num_experts": "i32", "num_tiles": "i32"}
    compile_for_hopper(md._runs_kernel, runs, dict(BLOCK_M=16, BLOCK_E=2 * block_e, BLOCK_T=64))
    place = {"ids_ptr": "*i32", "cursors_ptr": "*i32", "sorted_ids_ptr": "*i32"}
    place |= {"num_pairs": "i32", "num_experts": "i32"}
    compile_for_hopper(md._place_kernel, place, dict(BLOCK=1024))


def compile_prefill_split(fp8=False):
    from engine.layers.attention import triton_prefill_split as ts

    sig = {"q_ptr": "*bf16"} | kv_cache_sig(fp8)
    sig |= dict.fromkeys(["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"], "*i32")
    sig |= dict.fromkeys(["part_out_ptr", "part_lse_ptr"], "*fp32")
    sig |= {"out_ptr": "*bf16", "scale": "fp32"}
    strides = ["stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head"]
    strides += ["stride_cache_block", "stride_cache_slot", "stride_cache_head", "stride_bt"]
    sig |= dict.fromkeys([*strides, "num_tokens", "num_splits"], "i32")
    const = dict(GROUP=4, TOKS=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=32)
    for one in (True, False):
        split_const = const | {"ONE_SPLIT": one, "BLOCK_SIZE": 16, "KV_FP8": fp8}
        compile_for_hopper(ts._prefill_split_kernel, sig, split_const, num_stages=2)
    red = dict.fromkeys(["part_out_ptr", "part_lse_ptr"], "*fp32") | {"out_ptr": "*bf16"}
    red |= dict.fromkeys(["query_start_loc_ptr", "seq_lens_ptr"], "*i32")
    red |= dict.fromkeys(["stride_o_tok", "stride_o_head", "num_tokens", "num_splits"], "i32")
    compile_for_hopper(ts._prefill_merge_kernel, red, const)


def child() -> dict:
    report = {}
    for case in SKINNY_CASES:
        report[f"skinny_gemm{case}"] = compile_skinny_gemm(*case)
    for has_norm, store_kv in ((True, True), (False, False)):
        compile_rope_qk(has_norm, store_kv)
        report[f"rope_qk(norm={has_norm}, store={store_kv})"] = True
    for num_splits in (1, 33):
        compile_decode_attention(num_splits)
        report[f"decode_attention(splits={num_splits})"] = True
    compile_decode_attention(33, sliding=True, softcap=True)
    report["decode_attention(sliding, softcap)"] = True
    for sliding, softcap in ((False, False), (True, False), (True, True)):
        compile_prefill_attention(sliding, softcap)
        report[f"prefill_attention(sliding={sliding}, softcap={softcap})"] = True
    compile_prefill_split()
    report["prefill_split_attention"] = True
    # An FP8 KV cache: every kernel that reads or writes it.
    compile_decode_attention(33, fp8=True)
    compile_prefill_attention(False, False, fp8=True)
    compile_prefill_split(fp8=True)
    compile_store_kv(fp8=True)
    report["fp8_kv"] = True
    for case in MOE_CASES:
        report[f"fused_moe{case}"] = compile_fused_moe(*case)
    compile_moe_dispatch(8, 128, True)
    compile_moe_dispatch(2, 8, False)
    report["moe_dispatch"] = True
    return report


MOE_CASES = [
    (False, True, (16, 64, 128, 1, 4, 3)),  # decode-sized gate/up
    (True, True, (64, 128, 64, 8, 8, 3)),  # prefill-sized down, routing weight applied
    (True, False, (32, 64, 64, 8, 4, 3)),  # K not a multiple of the tile
]


@pytest.mark.skipif(HOPPER is None, reason="no triton with a CUDA backend here")
def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_compile_hopper"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode != 0 and "ptxas" in done.stderr and "No such file" in done.stderr:
        pytest.skip("no ptxas in this triton")  # pragma: no cover
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == len(SKINNY_CASES) + 11 + len(MOE_CASES)
    # The tensor-core tile is pipelined by Triton (the FMA tiles prefetch by hand).
    assert report[f"skinny_gemm{SKINNY_CASES[-1]}"] is True
    # So are the fused MoE tiles (the loads of the next K tile overlap the dot).
    assert all(report[f"fused_moe{case}"] for case in MOE_CASES)


if __name__ == "__main__":
    print(json.dumps(child()))
