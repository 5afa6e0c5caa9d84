"""Requests that need the room reservations hold wait for it (engine level).

On a decode node a disaggregated request holds its KV blocks (and, with LoRA,
its adapter's device slot) from its reservation until its KV lands or the
reservation ends (its lease runs out, an abort). A local request (or a remote
prefill that fell back to local), or a swapped one, that needs that room
waits: the step that finds so is an idle step, not the engine's failure; no
step runs until a command changes something (the engine thread blocks on its
commands); and once the reservations land or end, everything runs and equals
HF transformers (+ PEFT), every block and adapter slot free at the end. A
prefill node's blocks held for a transfer are waited for the same way.

A reservation's KV is computed on a second engine of the same tiny model and
copied into the reserved blocks (tests/engine/test_disaggregation.py streams it
layer by layer; what matters here is when the room comes back).
"""

from __future__ import annotations

import queue
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.device import GiB
from engine.engine_thread import EngineThread
from engine.llm_engine import LLMEngine, Reservation
from tests.conftest import hf_greedy_ids
from tests.engine.conftest import assert_idle
from tests.engine.test_lora import make_lora_setup  # skips without peft
from tests.unit.engine.helpers import make_seq

BS = 16
POOL = 8  # blocks: two 40-token prompts' reservations leave 2
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
# One KV block of the tiny Llama in fp32: K and V x 2 layers x 16 tokens x 2 heads x 16.
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def prefill_llm(tiny):
    """Computes the reservations' prompts (a prefill node's part)."""
    return _llm(tiny[0])


def _llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 64)
    return LLM(str(model_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
               kvcache_block_size=BS, **kwargs)  # fmt: skip


def _prompts(n: int, length: int = 40, seed: int = 11) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (length,), generator=gen).tolist() for _ in range(n)]


def _prefill(prefill: LLM, res: Reservation, prompt: list[int], lora=None):
    """The prompt's first token and its KV from ``first_block`` on, computed
    on the prefill engine (its blocks held, then released)."""
    p = prefill.llm_engine
    rid = res.request_id
    p.add_request(rid, prompt, GREEDY.clone(max_tokens=1), hold_kv=True, lora_request=lora)
    first = None
    while p.has_work():
        for out in p.step():
            first = out.outputs[0].token_ids[0] if out.finished else first
    held = p.take_held(rid)
    data = p.model_runner.gather_kv(held.block_table[res.first_block : len(res.block_ids)])
    p.release_held(rid)
    return first, data


def _land(engine: LLMEngine, res: Reservation, first: int, data: torch.Tensor) -> None:
    """The KV lands in the reserved blocks and the request commits."""
    engine.model_runner.scatter_kv(res.blocks_to_fill, data)
    engine.commit_request(res.request_id, first)


def _run(engine: LLMEngine, finals: dict) -> None:
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out


def _must_wait(engine: LLMEngine) -> None:
    """The engine finds it can run nothing until the room comes back: an idle
    step, then none at all until something changes."""
    steps = engine.scheduler.stats.num_steps
    assert engine.step() == []
    assert engine.scheduler.waits_for_room()
    assert not engine.has_work()  # the engine thread would block on its commands
    for _ in range(3):
        assert engine.step() == []
    assert engine.scheduler.stats.num_steps == steps + 1  # scheduled once, not again


@pytest.mark.parametrize("end", ["land", "abort"])
def test_a_local_request_waits_for_reservations_holding_the_blocks(tiny, prefill_llm, end):
    model_dir, hf = tiny
    decode = _llm(model_dir, num_kvcache_blocks=POOL)
    d = decode.llm_engine
    prompts = _prompts(3)
    res = [d.reserve_request(f"r{i}", prompts[i], GREEDY) for i in range(2)]
    assert all(res) and d.block_manager.num_free_blocks == 2
    d.add_request("local", prompts[2], GREEDY)  # 3 blocks
    _must_wait(d)
    # A prompt that could never fit is still refused at admission.
    with pytest.raises(ValueError, match="max_model_len"):
        d.add_request("huge", list(range(1, 65)), GREEDY)
    finals: dict = {}
    if end == "land":
        for r, prompt in zip(res, prompts, strict=False):
            _land(d, r, *_prefill(prefill_llm, r, prompt))
    else:  # the leases ran out: the node aborts the reservations
        d.abort_request(["r0", "r1"])
    assert d.has_work()
    _run(d, finals)
    want = {"local": prompts[2]} | ({"r0": prompts[0], "r1": prompts[1]} if end == "land" else {})
    for rid, prompt in want.items():
        assert finals[rid].outputs[0].token_ids == hf_greedy_ids(hf, prompt, NEW_TOKENS), rid
    if end == "abort":
        assert [finals[r].outputs[0].finish_reason for r in ("r0", "r1")] == ["abort"] * 2
    assert_idle(decode)


def test_the_engine_thread_blocks_while_reservations_hold_the_room(tiny, prefill_llm):
    """Served: the thread neither dies nor spins while the local request waits,
    and the commits (commands) wake it."""
    model_dir, hf = tiny
    decode = _llm(model_dir, num_kvcache_blocks=POOL)
    d = decode.llm_engine
    prompts = _prompts(3)
    thread = EngineThread(d, name="room-wait").start()
    got: queue.SimpleQueue = queue.SimpleQueue()
    try:
        res = [
            thread.call(lambda e, i=i: e.reserve_request(f"r{i}", prompts[i], GREEDY)).result(10)
            for i in range(2)
        ]
        added = thread.add("local", got.put, lambda e: e.add_request("local", prompts[2], GREEDY))
        added.result(10)
        deadline = time.monotonic() + 10
        while not (thread.idle and d.scheduler.stats.num_steps):
            assert time.monotonic() < deadline and thread.alive
            time.sleep(0.01)
        calls: list[float] = []
        step = d.step
        d.step = lambda: calls.append(time.monotonic()) or step()  # the thread's steps
        time.sleep(0.5)  # ten of the thread's idle polls
        assert calls == [] and thread.idle and thread.alive
        assert d.scheduler.waiting
        for r, prompt in zip(res, prompts, strict=False):
            first, data = _prefill(prefill_llm, r, prompt)
            thread.call(lambda e, r=r, first=first, data=data: _land(e, r, first, data)).result(10)
        out = got.get(timeout=30)
        while not (isinstance(out, BaseException) or out.finished):
            out = got.get(timeout=30)
        assert not isinstance(out, BaseException), out
        assert out.outputs[0].token_ids == hf_greedy_ids(hf, prompts[2], NEW_TOKENS)
        deadline = time.monotonic() + 30
        while d.has_unfinished_requests():  # the committed requests finish too
            assert time.monotonic() < deadline and thread.alive
            time.sleep(0.01)
    finally:
        thread.stop()
    assert thread.error is None and calls  # the commits woke it
    assert_idle(decode)


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    return make_lora_setup(tiny_model, tmp_path_factory)


@pytest.mark.parametrize("end", ["land", "abort"])
def test_a_request_waits_for_an_adapter_slot_reservations_hold(lora_setup, end):
    """Both device slots are held by reserved requests of two other adapters."""
    model_dir, _, adapters = lora_setup
    lora = {"enable_lora": True, "max_lora_rank": 8}
    decode = _llm(model_dir, max_loras=2, **lora)
    d = decode.llm_engine
    prompts = _prompts(3)
    res = [
        d.reserve_request(f"r{i}", prompts[i], GREEDY, lora_request=adapters[i][0])
        for i in range(2)
    ]
    assert all(res)
    d.add_request("local", prompts[2], GREEDY, lora_request=adapters[2][0])
    _must_wait(d)
    finals: dict = {}
    if end == "land":
        prefill = _llm(model_dir, max_loras=3, **lora)
        for i, r in enumerate(res):
            _land(d, r, *_prefill(prefill, r, prompts[i], adapters[i][0]))
    else:
        d.abort_request(["r0", "r1"])
    _run(d, finals)
    ran = range(3) if end == "land" else [2]
    for i in ran:
        rid = "local" if i == 2 else f"r{i}"
        oracle = adapters[i][1]
        assert finals[rid].outputs[0].token_ids == hf_greedy_ids(oracle, prompts[i], NEW_TOKENS)
    slots = d.scheduler.lora_slots
    assert all(slots.users(a.lora_int_id) == 0 for a, _ in adapters)
    assert_idle(decode)


def test_a_swapped_request_waits_for_reservations_holding_the_blocks(tiny, prefill_llm):
    """Swapped out while reservations filled the pool, a request resumes once
    they have run."""
    model_dir, hf = tiny
    decode = _llm(
        model_dir,
        num_kvcache_blocks=POOL,
        swap_space=16 * BLOCK_BYTES / GiB,
        preemption_mode="swap",
    )
    d = decode.llm_engine
    prompts = _prompts(2) + _prompts(1, length=20, seed=12)
    local = _prompts(1, length=30, seed=13)[0]  # 2 blocks
    d.add_request("local", local, GREEDY)
    d.step()  # its prompt: 2 blocks, and tokens up to 32 fit them
    res = [d.reserve_request(f"r{i}", prompts[i], GREEDY) for i in range(2)]  # 6 blocks
    assert all(res) and d.block_manager.num_free_blocks == 0
    while not d.scheduler.swapped:  # its 33rd token needs a block: swapped out
        d.step()
    assert d.scheduler.stats.num_swap_preemptions == 1
    res.append(d.reserve_request("r2", prompts[2], GREEDY))  # takes the blocks it left
    assert res[2] is not None and d.block_manager.num_free_blocks == 0
    _must_wait(d)
    for r, prompt in zip(res, prompts, strict=True):
        _land(d, r, *_prefill(prefill_llm, r, prompt))
    finals: dict = {}
    _run(d, finals)
    for rid, prompt in [("local", local)] + [(f"r{i}", p) for i, p in enumerate(prompts)]:
        assert finals[rid].outputs[0].token_ids == hf_greedy_ids(hf, prompt, NEW_TOKENS), rid
    assert d.host_tier.num_free_slots == d.host_tier.num_slots
    assert_idle(decode)


def test_a_request_waits_for_blocks_held_for_a_transfer(tiny):
    """Prefill node: finished prompts' blocks held for their transfers fill
    the pool; the next prompt runs once one is released."""
    model_dir, hf = tiny
    llm = _llm(model_dir, num_kvcache_blocks=POOL)
    p = llm.llm_engine
    prompts = _prompts(3)
    one = GREEDY.clone(max_tokens=1)
    for i in range(2):
        p.add_request(f"h{i}", prompts[i], one, hold_kv=True)
    _run(p, {})
    assert p.num_held() == 2 and p.block_manager.num_free_blocks == 2
    p.add_request("next", prompts[2], GREEDY)
    _must_wait(p)
    p.release_held("h0")
    finals: dict = {}
    _run(p, finals)
    assert finals["next"].outputs[0].token_ids == hf_greedy_ids(hf, prompts[2], NEW_TOKENS)
    p.release_held("h1")
    assert_idle(llm)


def test_an_empty_step_with_nothing_to_wait_for_still_fails(tiny):
    """Blocks gone with no reservation or held request to give them back (an
    inconsistent state): the engine still refuses to idle, and says why."""
    llm = _llm(tiny[0], num_kvcache_blocks=POOL)
    engine = llm.llm_engine
    leak = make_seq(90, block_size=BS, hashed=False)  # 6 blocks nobody will free
    assert engine.block_manager.allocate_slots(leak, 90)
    engine.add_request("local", _prompts(1)[0], GREEDY)
    with pytest.raises(RuntimeError, match=r"1 waiting, 0 swapped, 0 running; 2 of 8 blocks"):
        engine.step()
    engine.block_manager.free(leak)
    engine.abort_request("local")
    engine.step()
    assert_idle(llm)
