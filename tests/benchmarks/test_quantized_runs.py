"""FP8 measurement tooling: the numerics options reach each engine of a
benchmark run (pdserve offline, the vLLM peer's call, a served node), the
records name them, and the HBM floor counts FP8 bytes."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import model_step, offline_throughput, serve_side_by_side
from benchmarks.peers import vllm_peer
from common.runtime.config import NodeConfig, add_node_arguments
from engine.config import EngineConfig
from engine.kv_cache_dtype import KVCacheDType
from engine.models.shapes import SHAPES, write_shape_dir
from engine.quantization.scheme import Quantization

TINY_RUN = ["--shape", "tiny", "--num-seqs", "3", "--min-input-len", "8", "--max-input-len", "16"]
TINY_RUN += ["--min-output-len", "3", "--max-output-len", "6", "--device", "cpu"]
# The KV pool of both runs (tiny: 2 layers x 2 KV heads x 16 x 16 tokens a block).
KV_POOL_BYTES = 3 << 20


def test_fp8_run_and_its_unquantized_baseline_share_one_record(tmp_path):
    argv = [*TINY_RUN, "--dtype", "bfloat16", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    argv += ["--kv-cache-memory-bytes", str(KV_POOL_BYTES)]
    offline_throughput.main([*argv, "--unquantized-baseline", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("offline_throughput-*.json")
    results = json.loads(path.read_text())["results"]
    fp8, base = results["pdserve"], results["pdserve_unquantized"]
    assert (fp8["quantization"], fp8["kv_cache_dtype"]) == ("fp8", "float8_e4m3fn")
    assert (base["quantization"], base["kv_cache_dtype"]) == (None, "bfloat16")
    assert fp8["dtype"] == base["dtype"] == "bfloat16"
    assert fp8["output_tokens"] == base["output_tokens"]  # the same workload
    assert results["ratio_vs_unquantized"] == fp8["output_tok_per_s"] / base["output_tok_per_s"]
    # One byte an element against two: twice the blocks in the same memory.
    assert base["kv_block_bytes"] == 2 * fp8["kv_block_bytes"]
    assert results["kv_blocks_at_equal_memory_vs_unquantized"] == 2.0
    assert base["num_kvcache_blocks"] == KV_POOL_BYTES // base["kv_block_bytes"]
    assert fp8["num_kvcache_blocks"] == 2 * base["num_kvcache_blocks"]
    assert fp8["kv_cache_bytes"] == base["kv_cache_bytes"] <= KV_POOL_BYTES


def test_unquantized_baseline_needs_a_quantized_run(tmp_path):
    with pytest.raises(SystemExit, match="--unquantized-baseline compares"):
        offline_throughput.main([*TINY_RUN, "--unquantized-baseline", "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_vllm_peer_runs_the_same_numerics():
    def kwargs(*extra: str) -> dict:
        args = offline_throughput.parse_args(["--peer", "vllm", *extra])
        offline_throughput.resolve_defaults(args, on_gpu=True)
        return vllm_peer.engine_kwargs(Path("/m"), args)

    fp8 = kwargs("--quantization", "fp8", "--kv-cache-dtype", "fp8")
    assert (fp8["quantization"], fp8["kv_cache_dtype"]) == ("fp8", "fp8")
    assert "quantization" not in kwargs() and "kv_cache_dtype" not in kwargs()
    assert kwargs("--kv-cache-dtype", "fp8_e4m3")["kv_cache_dtype"] == "fp8_e4m3"
    assert kwargs("--kv-cache-memory-bytes", "1024")["kv_cache_memory_bytes"] == 1024


def _tiny_runner(tmp_path, *numerics: str):
    args = model_step.parse_args(["decode", "--backend", "torch", "--enforce-eager", *numerics])
    return model_step.make_runner("tiny", str(tmp_path), args, 64, 8, 2, device="cpu")


def test_decode_floor_counts_fp8_bytes(tmp_path):
    plain = _tiny_runner(tmp_path / "plain")
    fp8 = _tiny_runner(tmp_path / "fp8", "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    cfg = SHAPES["tiny"]
    h, layers, head_dim = cfg["hidden_size"], cfg["num_hidden_layers"], 16
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    inter = cfg["intermediate_size"]
    # Every projection of a layer: its weights (in, out) and output rows.
    proj_params = layers * (h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h)
    proj_rows = layers * ((q + 2 * kv) + h + 2 * inter + h)
    elem = torch.empty(0, dtype=plain.dtype).element_size()
    # FP8: one byte a weight instead of the model dtype's, plus a float32 scale a row.
    saved = proj_params * (elem - 1) - proj_rows * 4
    assert model_step.weight_bytes_read(plain) - model_step.weight_bytes_read(fp8) == saved
    per_token = layers * 2 * kv  # K and V elements of one token
    assert model_step.kv_bytes_read(fp8, 3, 10) == 3 * 10 * per_token
    assert model_step.kv_bytes_read(plain, 3, 10) == 3 * 10 * per_token * elem


def test_serve_fp8_system_starts_its_node_with_fp8(tmp_path, monkeypatch):
    import pdserve.launcher

    specs = []

    class RecordedCluster(contextlib.nullcontext):
        def __init__(self, spec):
            super().__init__(self)
            specs.append(spec)
            self.router_address = "127.0.0.1:1"
            self.components = [SimpleNamespace(name="decode-0", metrics_url=None)]

    monkeypatch.setattr(pdserve.launcher, "LocalCluster", RecordedCluster)
    args = serve_side_by_side.build_parser().parse_args(["--no-http", "--out", str(tmp_path)])
    args.model_dir = write_shape_dir("tiny", tmp_path / "model")
    with serve_side_by_side.UP["pdserve-fp8"](args, tmp_path) as sweeps:
        assert [s.label for s in sweeps] == ["pdserve-fp8-grpc"]
    with serve_side_by_side.UP["pdserve"](args, tmp_path) as sweeps:
        assert [s.label for s in sweeps] == ["pdserve-grpc"]
    configs = []
    for spec in specs:  # the node's own flag parsing, then the engine's config
        parser = argparse.ArgumentParser()
        add_node_arguments(parser, default_port=0)
        node = NodeConfig.from_args(parser.parse_args(["--model", spec.model, *spec.engine_args]))
        configs.append(EngineConfig(model=spec.model, **node.engine))
    fp8, plain = configs
    assert (fp8.quantization, fp8.kv_cache_dtype.is_fp8) == (Quantization.FP8, True)
    assert (plain.quantization, plain.kv_cache_dtype) == (None, KVCacheDType.AUTO)
