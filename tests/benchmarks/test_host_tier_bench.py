"""serve_side_by_side.py's host KV tier measurement: the multi-turn workload
through pdserve's HTTP API with a host tier and without one, live on the tiny shape
(real nodes, a real router, the real load generator), and vLLM's side by its
command line (vLLM is not installed here)."""

from __future__ import annotations

import json
import signal

import pytest

from benchmarks import serve_side_by_side as sbs
from benchmarks.support.kv_tier import GiB, kv_bytes_per_token, parse_spec
from engine.models.config import ModelArchConfig

pytestmark = pytest.mark.timeout(300)

# 8 users of 3 turns on 2 system prompts: a working set of about 3 pools of
# the smallest pool a 4096-token max_model_len allows (256 blocks).
TINY = ["users=8", "turns=3", "systems=2", "system_tokens=256"]
TINY += ["min_user_tokens=400", "max_user_tokens=600", "output_tokens=8"]


def test_multi_turn_hits_the_host_tier_and_the_summary_sets_it_against_none(tmp_path):
    # main() sets its own SIGTERM handler (to stop its servers): pytest's after it.
    handler = signal.getsignal(signal.SIGTERM)
    try:
        _run_tiny(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, handler)
    summary = json.loads((tmp_path / "summary.json").read_text())
    ws = summary["multi_turn_working_set"]
    # (2 x 256 + 8 x 3 x (500 + 8)) tokens over 256 blocks of 16.
    assert (ws["tokens"], ws["pool_blocks"], ws["pool_tokens"]) == (12704, 256, 4096)
    assert ws["ratio"] == pytest.approx(12704 / 4096, abs=1e-3)
    assert ws["bytes"] == 12704 * 512  # the tiny shape's K and V: 512 bytes a token
    # Multi-turn goes over HTTP, as vLLM's: each turn is built from the last
    # reply's token ids (return_token_ids); --no-grpc leaves the gRPC sweep out.
    runs = summary["multi_turn"]
    assert sorted(runs) == ["pdserve-host-tier-http", "pdserve-http"]
    for label, by_rate in runs.items():
        (fig,) = by_rate.values()
        assert (fig["completed"], fig["failed"]) == (24, 0), label  # every turn answered
        assert 0 < fig["ttft_p50_ms"] <= fig["ttft_p90_ms"]
        assert fig["goodput"] > 0
    (pair,) = summary["multi_turn_tier_vs_without"][
        "pdserve-host-tier-http vs pdserve-http"
    ].values()
    assert pair["ttft_p50_speedup"] > 0 and pair["ttft_p90_speedup"] > 0
    assert pair["meets_ttft_target"] == (pair["ttft_p50_speedup"] >= 2)
    copy_in = summary["host_tier_copy_in"]
    assert copy_in["copy_rate"]["device"] == "cpu" and copy_in["copy_rate"]["bytes_per_s"] > 0
    tier, plain = copy_in["systems"]["pdserve-host-tier"], copy_in["systems"]["pdserve"]
    # The tier held what --swap-space sized it for, and the conversations came back through it.
    assert tier["host_kv_blocks"] == int(ws["host_tier_gib_used"] * GiB) // (16 * 512)
    assert tier["hit_blocks"] > 0 and tier["blocks_to_host"] > 0
    assert tier["bytes_to_device"] == tier["blocks_to_device"] * 16 * 512
    assert tier["copy_in_seconds"] > 0
    rate = tier["bytes_to_device"] / tier["copy_in_seconds"]
    assert tier["copy_in_bytes_per_s"] == pytest.approx(rate)
    assert tier["copy_in_over_copy_rate"] == pytest.approx(
        rate / copy_in["copy_rate"]["bytes_per_s"]
    )
    assert plain["host_kv_blocks"] == plain["hit_blocks"] == plain["bytes_to_device"] == 0
    assert plain["copy_in_over_copy_rate"] is None and not plain["meets_copy_in_target"]
    assert summary["host_tier_targets"] == {
        "ttft_p50_speedup_at_least": 2.0,
        "copy_in_over_copy_rate_at_least": 0.7,
    }
    assert summary["systems_without_records"] == []


def _run_tiny(out) -> None:
    sbs.main(
        ["--shape", "tiny", "--systems", "pdserve-host-tier", "pdserve", "--workloads"]
        + ["multi-turn", "--multi-turn", *TINY, "--multi-turn-rates", "inf", "--no-grpc"]
        + ["--out", str(out), "--time-budget", "200", "--start-timeout", "90"]
    )


def test_vllm_gets_the_same_pool_and_an_offloading_tier_of_the_same_size(tmp_path):
    args = sbs.build_parser().parse_args(
        ["--systems", "vllm-offload", "vllm", "pdserve-host-tier", "--workloads", "multi-turn"]
        + ["--out", str(tmp_path)]
    )
    sbs.prepare(args)  # the default: Llama-3.1-8B's shape, the GPU run's conversations
    arch = ModelArchConfig.from_dir(args.model_dir)
    assert kv_bytes_per_token(arch) == 2 * 32 * 8 * 128 * 2
    ws = json.loads((tmp_path / "working-set.json").read_text())
    assert 3 <= ws["ratio"] <= 4 and ws["longest_tokens"] <= sbs.MAX_MODEL_LEN
    assert ws["host_tier_gib_used"] * GiB >= ws["bytes"]
    plain = sbs.vllm_command(args, 8000, [])
    offload = sbs.vllm_command(args, 8000, sbs.vllm_offload_args(args))

    def flag(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    for cmd in (plain, offload):
        assert flag(cmd, "--num-gpu-blocks-override") == str(ws["pool_blocks"])
        assert flag(cmd, "--block-size") == "16"
        assert flag(cmd, "--max-model-len") == "4096"
    assert "--kv-transfer-config" not in plain
    kv = json.loads(flag(offload, "--kv-transfer-config"))
    assert (kv["kv_connector"], kv["kv_role"]) == ("OffloadingConnector", "kv_both")
    extra = kv["kv_connector_extra_config"]
    assert extra == {"cpu_bytes_to_use": int(ws["host_tier_gib_used"] * GiB), "block_size": 16}
    # pdserve's node: the same pool, and the tier of the same size.
    assert args.pool_args["pdserve"] == ["--num-kvcache-blocks", str(ws["pool_blocks"])] + [
        "--kvcache-block-size",
        "16",
    ]
    assert sbs.tier_args(args) == ["--swap-space", str(ws["host_tier_gib_used"])]


def test_multi_turn_runs_on_its_own_and_takes_known_fields(tmp_path):
    args = sbs.build_parser().parse_args(
        ["--workloads", "multi-turn", "random", "--out", str(tmp_path)]
    )
    with pytest.raises(ValueError, match="run it on its own"):
        sbs.prepare(args)
    with pytest.raises(ValueError, match="FIELD=N"):
        parse_spec(["user=8"])
    with pytest.raises(ValueError, match="past max_model_len"):
        args = sbs.build_parser().parse_args(
            ["--workloads", "multi-turn", "--multi-turn", "turns=40", "--out", str(tmp_path)]
        )
        sbs.prepare(args)
