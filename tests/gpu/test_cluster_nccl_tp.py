"""Prefill and decode nodes of different tensor-parallel sizes on GPUs (NCCL).

Run on a host with three or more GPUs: ``python -m pytest tests/gpu -m multi_gpu``.
Skipped elsewhere (the CPU path of the same code, over gloo, is
tests/integration/test_tensor_parallel_nodes.py).

Dummy weights of a 16-head, 4-KV-head shape (a seed gives the same model at
every tensor-parallel size): a prefill node of size 2 streams to a decode node
of size 1, then (a second cluster) size 1 to size 2, each node on its own GPUs
(``pdserve up``'s assignment). The decode node's greedy tokens equal the
offline engine's at size 1, and every transfer landed whole.
"""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch

from engine import LLM, SamplingParams
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.redis_server import free_port
from proto.client import generate
from tests.conftest import REMOTE_PREFILL_ONLY
from tests.faults.harness import nodes, wait_idle
from tests.gpu.test_tensor_parallel_cuda import CONFIG

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 3,
        reason="needs three or more CUDA GPUs",
    ),
]

PROMPTS = [list(range(13 * i, 13 * i + 40 + 61 * i)) for i in range(4)]  # 40..223 tokens
ENGINE = ["--max-model-len", "512", "--dtype", "float32", "--load-format", "dummy"]
ENGINE += ["--gpu-memory-utilization", "0.3", "--skip-tokenizer-init"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dummy-16-heads")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        gpu_memory_utilization=0.3,
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    try:
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return [o.outputs[0].token_ids for o in out]
    finally:
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["2-to-1", "1-to-2"])
def test_mixed_sizes_over_nccl_give_the_size_1_tokens(
    model_dir, expected, tmp_path, prefill_tp, decode_tp
):
    spec = ClusterSpec(
        model=str(model_dir),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        port=free_port(),
        admin_port=free_port(),
        engine_args=ENGINE,
        node_args=["--heartbeat-interval", "0.2"],
        router_args=REMOTE_PREFILL_ONLY + ["--skip-tokenizer-init"],
        log_dir=str(tmp_path),
        start_timeout_s=600,
    )
    with LocalCluster(spec) as cluster:
        got = []
        for ids in PROMPTS:
            tokens, final = [], None
            for r in generate(
                cluster.router_address,
                token_ids=ids,
                max_tokens=16,
                temperature=0.0,
                ignore_eos=True,
                timeout=300,
            ):
                for d in r.deltas:
                    tokens.extend(d.token_ids)
                if r.HasField("final"):
                    final = r.final
            assert final.usage.prefill_node == "prefill-0"  # crossed NCCL
            got.append(tokens)
        wait_idle(cluster, timeout_s=30)
        time.sleep(0.5)
        info = nodes(cluster)
    assert got == expected
    assert info["prefill-0"].tensor_parallel_size == info["prefill-0"].num_gpus == prefill_tp
    assert info["decode-0"].tensor_parallel_size == info["decode-0"].num_gpus == decode_tp
    assert info["decode-0"].kv_transfers == len(PROMPTS)
    assert info["decode-0"].kv_transfer_failures == 0
