"""A node loading and unloading LoRA adapters while it serves
(common/runtime/node_lora_control.py), on a real engine thread over a tiny
random Llama with random PEFT adapters: each refusal with its status and a
message naming the node, the registration updated (and published) before
the answer, a request in flight when its adapter is unloaded finishing on it
(as HF + PEFT computes), and a node without --enable-lora refusing loads."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from common.cluster.state import NodeInfo, NodeRole, lora_adapters_of
from common.runtime.node_lora import AdapterRefused, NodeAdapters
from common.runtime.node_lora_control import NodeLoRAControl
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine
from engine.request_stream import RequestStream
from engine.sampling_params import SamplingParams
from tests.engine.test_lora import NEW_TOKENS, _hf_greedy, _prompts, make_lora_setup

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    return make_lora_setup(tiny_model, tmp_path_factory)


def _control(model_dir, **kwargs) -> NodeLoRAControl:
    engine = LLMEngine.from_engine_args(
        str(model_dir), device="cpu", dtype="float32", max_model_len=256,
        skip_tokenizer_init=True, num_kvcache_blocks=64, **kwargs,
    )  # fmt: skip
    info = NodeInfo("d0", NodeRole.DECODE, "127.0.0.1:1", "m", 16)
    return NodeLoRAControl(EngineThread(engine).start(), NodeAdapters(), info)


async def _refusal(work) -> AdapterRefused:
    with pytest.raises(AdapterRefused) as info:
        await work
    return info.value


def test_load_refusals_unload_drains_and_the_registration_follows(lora_setup, tmp_path):
    model_dir, _, adapters = lora_setup
    a1, hf1 = adapters[0]  # rank 4
    control = _control(model_dir, enable_lora=True, max_lora_rank=8)
    published = []

    async def publish():
        published.append(control.info.lora_adapters)

    control.publish = publish
    prompt = _prompts(1)[0]

    async def main():
        e = await _refusal(control.load("x", str(tmp_path / "nowhere")))
        assert e.code == grpc.StatusCode.NOT_FOUND and str(e).startswith("node d0: ")
        big = shutil.copytree(a1.lora_path, tmp_path / "r16")
        config = json.loads((big / "adapter_config.json").read_text())
        (big / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
        e = await _refusal(control.load("big", str(big)))
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "above max_lora_rank 8" in str(e)
        not_peft = shutil.copytree(a1.lora_path, tmp_path / "not-peft")
        (not_peft / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
        e = await _refusal(control.load("pt", str(not_peft)))
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "not LORA" in str(e)
        assert published == [] and not control.adapters.by_name  # nothing half-loaded

        reply = await control.load("a1", a1.lora_path)
        assert reply.rank == 4 and lora_adapters_of(control.info) == {"a1": reply.digest}
        assert published == [control.info.lora_adapters]  # before the answer
        e = await _refusal(control.load("a1", a1.lora_path))
        assert e.code == grpc.StatusCode.ALREADY_EXISTS

        # A request under it, in flight when it is unloaded: it finishes on it.
        stream = RequestStream()
        request = control.adapters.by_name["a1"][0]
        # Long enough to be running when the unload reaches the engine thread.
        params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
        add = control.thread.add(
            "r", stream.sink, lambda e: e.add_request("r", prompt, params, lora_request=request)
        )
        await asyncio.wrap_future(add)
        reply = await control.unload("a1")
        assert reply.requests_in_flight == 1 and lora_adapters_of(control.info) == {}
        outs = [out async for out in stream]
        got = list(outs[-1].outputs[0].token_ids)
        assert len(got) == 96 and got[:NEW_TOKENS] == _hf_greedy(hf1, prompt)
        assert not control.thread.engine.model_runner.lora.host  # freed after the last
        e = await _refusal(control.unload("a1"))
        assert e.code == grpc.StatusCode.NOT_FOUND
        # Loaded again: a new id (an id always means the same files).
        again = await control.load("a1", a1.lora_path)
        assert control.adapters.by_name["a1"][0].lora_int_id == 2 and again.digest

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        control.thread.stop()


def test_a_node_without_enable_lora_refuses_loads(lora_setup):
    model_dir, _, adapters = lora_setup
    control = _control(model_dir)
    try:
        e = asyncio.run(_refusal(control.load("a1", adapters[0][0].lora_path)))
    finally:
        control.thread.stop()
    assert e.code == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" in str(e)
