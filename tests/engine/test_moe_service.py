"""A disaggregated request through `pdserve up` on a mixture-of-experts model
equals the local engine's: the service is model-agnostic (KV transfer, block
hashes and routing follow the config's head counts), so nothing in it knows
the model is an MoE.

The model: a tiny random Qwen3-MoE (tests/conftest.py's shape) with the demo
model's vocabulary, tokenizer and chat template, so the router can tokenize.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from pdserve.redis_server import free_port
from proto.client import generate_text
from tests.conftest import TINY_CONFIGS, build_tiny_hf_model
from tests.pdserve_up import UpProcess

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

MAX_LEN = 1024
# Over the router's 256-token local-prefill threshold: a prefill node computes it.
PROMPT = "Dossier M: " + " ".join(f"entry-{j} of the mixture archive" for j in range(90))


@pytest.fixture(scope="module")
def moe_dir(demo_model_dir, tmp_path_factory):
    TINY_CONFIGS["qwen3_moe-demo-vocab"] = dict(
        TINY_CONFIGS["qwen3_moe"],
        vocab_size=49152,
        max_position_embeddings=MAX_LEN,
        bos_token_id=1,
        eos_token_id=2,
    )
    out = tmp_path_factory.mktemp("tiny-moe-service")
    try:
        build_tiny_hf_model("qwen3_moe-demo-vocab", out)
    finally:
        del TINY_CONFIGS["qwen3_moe-demo-vocab"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo_model_dir / name, out / name)
    return out


def test_a_disaggregated_request_equals_the_local_engine(moe_dir, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(moe_dir), device="cpu", max_model_len=MAX_LEN)
    (local,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(local.prompt_token_ids) > 300
    # The directory's chat template and stop ids (generation_config.json) apply.
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert chat.prompt.startswith("<|im_start|>") and 2 in llm.llm_engine.eos_token_ids
    del llm
    up = UpProcess(
        ["--model", str(moe_dir), "--prefill", "1", "--decode", "1", "--port", str(free_port())]
        + ["--admin-port", str(free_port()), "--max-model-len", str(MAX_LEN)]
        + ["--log-dir", str(tmp_path / "logs")],
    )
    try:
        up.wait_ready()
        text, final = generate_text(
            up.router, PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, timeout=300
        )
        assert final.usage.prefill_node == "prefill-0"  # the KV crossed to the decode node
        assert final.usage.completion_tokens == 16
        assert text == local.outputs[0].text
        # pdctl nodes names each node's model family (from its registration).
        cmd = [sys.executable, "-m", "router.admin.pdctl", "--address", up.admin, "nodes"]
        listed = json.loads(subprocess.run(cmd + ["--json"], capture_output=True).stdout)
        assert {r["node_id"]: r["model_family"] for r in listed} == {
            "prefill-0": "qwen3_moe",
            "decode-0": "qwen3_moe",
        }
        table = subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()
        assert "FAMILY" in table[0] and all("qwen3_moe" in row for row in table[1:])
    finally:
        assert up.stop(timeout=120) == 0
