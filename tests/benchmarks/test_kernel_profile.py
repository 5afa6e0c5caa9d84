"""benchmarks/kernel_profile.py: kernel kinds, busy time and the summary (no GPU)."""

from __future__ import annotations

import pytest

from benchmarks import offline_throughput
from benchmarks.kernel_profile import KernelEvent, busy_us, kind_of, summarize


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNN", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits>", "attention"),
        ("cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", "attention"),
        ("_decode_split_kernel", "attention"),  # pdserve's Triton kernels
        ("_prefill_merge_kernel", "attention"),
        ("_store_kv_kernel", "kv_write"),
        ("_skinny_gemm_kernel", "gemm"),
        ("_split_k_reduce_kernel", "gemm"),
        ("_rope_qk_kernel", "rope"),
        ("_silu_and_mul_kernel", "activation"),
        ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16>", "kv_write"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
        ("_fused_add_rms_norm_kernel", "norm"),
        ("triton_poi_fused_mul_silu_slice_1", "activation"),
        ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rope"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "copy"),
        ("ncclDevKernel_SendRecv", "nccl"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernels_are_sorted_into_kinds(name, kind):
    assert kind_of(name) == kind


def test_busy_time_counts_overlap_once():
    events = [
        KernelEvent("a", 0.0, 10.0),  # 0-10
        KernelEvent("b", 5.0, 10.0),  # 5-15: 5 new
        KernelEvent("c", 6.0, 2.0),  # inside b: nothing new
        KernelEvent("d", 20.0, 4.0),  # after a gap
    ]
    assert busy_us(events) == pytest.approx(19.0)
    assert busy_us([]) == 0.0


def test_summary_sums_kinds_and_ranks_kernels():
    events = [
        KernelEvent("nvjet_gemm", 0.0, 300.0),
        KernelEvent("nvjet_gemm", 400.0, 300.0),
        KernelEvent("flash_attn_fwd", 700.0, 200.0),
        KernelEvent("rms_norm", 950.0, 50.0),
    ]
    s = summarize(events, wall_s=0.002, top=2)
    assert s["device_busy_s"] == pytest.approx(850e-6)
    assert s["kernel_sum_s"] == pytest.approx(850e-6)
    assert s["kernels"] == 4
    assert list(s["kinds"]) == ["gemm", "attention", "norm"]
    assert s["kinds"]["gemm"] == {"count": 2, "seconds": pytest.approx(600e-6)}
    assert [k["kernel"] for k in s["top_kernels"]] == ["nvjet_gemm", "flash_attn_fwd"]


def test_profile_flag_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a GPU"):
        offline_throughput.main(["--device", "cpu", "--profile", "--num-seqs", "1"])


def test_interleaved_timing_puts_every_function_first_equally_often():
    """A/B timings rotate their order round by round (benchmarks/common.py): over
    len(names) rounds each name is timed once per round and first once."""
    from benchmarks.common import interleaved_order

    order = interleaved_order(["a", "b", "c"], 6)
    rounds = [order[i : i + 3] for i in range(0, 18, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert [r[0] for r in rounds] == ["a", "b", "c", "a", "b", "c"]
    assert [r[-1] for r in rounds] == ["c", "a", "b", "c", "a", "b"]
    assert interleaved_order(["a", "b"], 2) == ["a", "b", "b", "a"]


def test_a_suites_record_names_its_device():
    """benchmarks/common.environment: the GPU(s) on a GPU host, else the CPU's model."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from benchmarks.common import environment

    env = environment()
    assert env["cpu"]
    if torch.cuda.is_available():
        assert env["device"] == torch.cuda.get_device_name() and env["devices"]
    else:
        assert env["device"] == f"cpu ({env['cpu']})"
