"""``offline_throughput.py --loras``: the rows, the adapters and the load cost (CPU, tiny).

The adapters the benchmark makes (on a meta-device base) are checked against
HF transformers + PEFT on a real tiny model: PEFT reads them back, and
pdserve's greedy output under one equals PEFT's and differs from the base's.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from benchmarks import offline_lora, offline_throughput
from benchmarks.peers import vllm_lora
from tests.conftest import hf_greedy_ids

peft = pytest.importorskip("peft")


def test_rows_for_0_1_and_n_adapters_and_the_load_cost(tmp_path):
    record = offline_throughput.main(
        ["--shape", "tiny", "--num-seqs", "6", "--min-input-len", "8", "--max-input-len", "24",
         "--min-output-len", "4", "--max-output-len", "10", "--device", "cpu", "--dtype",
         "float32", "--loras", "1,3", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    saved = json.loads(next(tmp_path.glob("offline_throughput-*.json")).read_text())
    assert saved == json.loads(json.dumps(record))
    base, lora = saved["results"]["pdserve"], saved["results"]["lora"]["pdserve"]
    assert lora["engine_kwargs"] == {
        "enable_lora": True, "max_loras": 3, "max_cpu_loras": 3, "max_lora_rank": 16,
    }  # fmt: skip
    # Every adapter changes the base model's greedy output.
    assert lora["probe_differs_from_base"] == [True, True, True]
    rows = lora["rows"]
    assert [r["adapters"] for r in rows] == [0, 1, 3]
    for r in rows:  # the same workload as the plain engine's, each row against it
        assert r["output_tokens"] == base["output_tokens"]
        assert r["ratio_vs_base"] == pytest.approx(r["output_tok_per_s"] / base["output_tok_per_s"])
    assert rows[0]["slot_loads"] == 0  # row 0 names no adapter
    cost = lora["load_cost"]
    # tiny: 2 layers, 7 modules, rank 16; A [16, in] and B [out, 16] in fp32.
    per_layer = 16 * (64 + 64) + 2 * 16 * (64 + 32) + 16 * (64 + 64) + 3 * 16 * (64 + 128)
    assert cost["adapter_bytes"] == 2 * per_layer * 4
    assert min(cost["read_ms"], cost["slot_copy_ms"], cost["prefill_token_ms"]) > 0
    assert len(cost["slot_copy_ms_all"]) == 8 and len(cost["prefill_token_ms_all"]) == 3
    assert cost["slot_copy_tokens"] == pytest.approx(
        cost["slot_copy_ms"] / cost["prefill_token_ms"]
    )
    assert cost["read_and_copy_tokens"] > cost["slot_copy_tokens"]


def test_made_adapters_are_peft_adapters_that_change_outputs(tiny_model, tmp_path):
    from benchmarks.support.lora_adapters import make_random_adapters
    from engine import LLM, LoRARequest, SamplingParams

    model_dir, hf_base = tiny_model("llama")
    dirs = make_random_adapters(model_dir, tmp_path, count=2, rank=8)
    prompt = torch.randint(1, 500, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128,
              skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=8)  # fmt: skip
    requests = [None] + [LoRARequest(f"a{k}", k + 1, str(d)) for k, d in enumerate(dirs)]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate([prompt] * 3, params, use_tqdm=False, lora_request=requests)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[0] == hf_greedy_ids(hf_base, prompt, 6)
    for d, ours in zip(dirs, got[1:], strict=True):
        # A copy: PEFT wraps the model it is given, and hf_base is the session's.
        oracle = peft.PeftModel.from_pretrained(copy.deepcopy(hf_base), d).eval()
        assert ours == hf_greedy_ids(oracle, prompt, 6)
    assert got[1] != got[0] and got[2] != got[0] and got[1] != got[2]


def test_counts_and_the_uniform_mix():
    assert offline_lora.parse_counts("1,8,32") == [1, 8, 32]
    for bad in ("0,8", "8,1", "1,1", "x"):
        with pytest.raises(ValueError, match="--loras takes"):
            offline_lora.parse_counts(bad)
    mixed = offline_lora.mix(["a", "b", "c"], 8)
    assert mixed == ["a", "b", "c", "a", "b", "c", "a", "b"]


def test_vllm_gets_the_same_lora_options():
    args = offline_throughput.parse_args(["--loras", "1,8,32", "--peer", "vllm"])
    offline_throughput.resolve_defaults(args, on_gpu=True)
    kwargs = vllm_lora.vllm_lora_kwargs(Path("/m"), args)
    assert kwargs["model"] == "/m" and kwargs["load_format"] == "dummy"
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_cpu_loras"]) == (True, 32, 32)
    assert kwargs["max_lora_rank"] == 16
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(SystemExit, match="needs the vllm package"):
            vllm_lora.run_vllm_loras(Path("/m"), args, [[1, 2]], [2], [Path("/a")])


def test_side_by_side_serving_loads_the_adapters_in_both_servers_and_names_them():
    import argparse

    from benchmarks import serve_side_by_side as sbs
    from pdserve.bench.cli import add_serve_arguments
    from pdserve.cli import build_parser

    dirs = [Path("/a/lora-0"), Path("/a/lora-1")]
    server, bench = sbs.lora_args(dirs, rank=16)
    assert server == ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
                      "--max-lora-rank", "16", "--lora-modules",
                      "lora-0=/a/lora-0", "lora-1=/a/lora-1"]  # fmt: skip
    # pdserve's decode node parses the same options (vLLM's names) ...
    node = build_parser().parse_args(["decode", "--model", "/m", *server])
    assert node.enable_lora and node.max_loras == 2 and node.max_lora_rank == 16
    assert len(node.lora_modules) == 2
    # ... and the load generator names the adapters.
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(bench).lora_modules == ["lora-0", "lora-1"]
