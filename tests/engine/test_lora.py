"""Multi-LoRA against HF transformers + PEFT, on a tiny random Llama (CPU, fp32).

Three random PEFT adapters (``init_lora_weights=False``: B is not zero) of
different ranks and target modules, one with rsLoRA, are the oracle's and the
engine's: a batch mixing the base model and all three in one ``generate``
equals HF + PEFT per prompt (greedy tokens and their logprobs); so does the
same batch through one device slot (``max_loras=1``) with two adapters in host
memory (the LRU evicts and re-reads); the prefix cache never serves one
adapter's KV to another or to the base; bad adapters and bad requests are
refused with the reason.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.block_hash import hash_prompt_blocks, lora_extra_key
from engine.lora.adapter import adapter_digest
from tests.conftest import hf_greedy_ids
from tests.engine.conftest import assert_idle

peft = pytest.importorskip("peft")

NEW_TOKENS = 8
# (name, rank, alpha, target modules, rslora)
ADAPTERS = [
    ("all-seven", 4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    ("attn-rslora", 8, 16, ["q_proj", "v_proj", "o_proj", "down_proj"], True),
    ("mlp-only", 2, 4, ["gate_proj", "up_proj"], False),
]  # fmt: skip


def _make_adapter(base, out_dir, rank, alpha, targets, rslora, seed):
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def lora_setup(tiny_model, tmp_path_factory):
    return make_lora_setup(tiny_model, tmp_path_factory)


def make_lora_setup(tiny_model, tmp_path_factory):
    """(model dir, HF base, [(LoRARequest, HF+PEFT model)])"""
    model_dir, hf_base = tiny_model("llama")
    adapters = []
    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        out = tmp_path_factory.mktemp(f"lora-{name}")
        oracle = _make_adapter(hf_base, out, rank, alpha, targets, rslora, seed=100 + i)
        adapters.append((LoRARequest(name, i + 1, str(out)), oracle))
    return model_dir, hf_base, adapters


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, 500, (length,), generator=gen).tolist() for _ in range(n)]


_ORACLE: dict[tuple[int, tuple[int, ...]], list[int]] = {}


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """HF's greedy tokens, computed once per (model, prompt) in this module."""
    key = (id(model), tuple(prompt))
    if key not in _ORACLE:
        _ORACLE[key] = hf_greedy_ids(model, prompt, NEW_TOKENS)
    return _ORACLE[key]


def _hf_logprobs(model, prompt: list[int], out: list[int]) -> list[float]:
    """HF's log-probability of each generated token."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)]


def _llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("max_lora_rank", 8)
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(model_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
               enable_lora=True, **kwargs)  # fmt: skip


def _check_mixed_batch(llm, hf_base, adapters) -> None:
    oracles = [hf_base] + [m for _, m in adapters]
    loras = [None] + [r for r, _ in adapters]
    # Two prompts per model, interleaved: every step mixes all four.
    prompts = _prompts(2 * len(oracles))
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    by_model: dict[int, list[list[int]]] = {}
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        oracle = oracles[i % len(oracles)]
        got = out.outputs[0].token_ids
        assert got == _hf_greedy(oracle, prompt), f"prompt {i}"
        want_lp = _hf_logprobs(oracle, prompt, got)
        got_lp = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, got, strict=True)]
        assert got_lp == pytest.approx(want_lp, abs=2e-4)
        by_model.setdefault(i % len(oracles), []).append(got)
    # The adapters change the outputs (or this test would prove nothing).
    assert len({tuple(map(tuple, v)) for v in by_model.values()}) == len(oracles)
    assert_idle(llm)


def test_mixed_batch_of_three_adapters_and_base_equals_hf_peft(lora_setup):
    model_dir, hf_base, adapters = lora_setup
    llm = _llm(model_dir, max_loras=3)
    _check_mixed_batch(llm, hf_base, adapters)
    runner = llm.llm_engine.model_runner
    assert runner.lora.num_slot_loads == 3  # each adapter copied into its slot once


def test_more_adapters_than_slots_wait_for_one_and_stay_correct(lora_setup):
    model_dir, hf_base, adapters = lora_setup
    llm = _llm(model_dir, max_loras=1, max_cpu_loras=2)
    _check_mixed_batch(llm, hf_base, adapters)
    lora = llm.llm_engine.model_runner.lora
    # First come, first served through one slot: a1 a2 a3 a1 a2 a3, each a
    # copy into the slot; from the fourth on the adapter had left the host
    # LRU of two and was read from disk again, and the outputs stayed right.
    assert lora.num_slot_loads == 6
    assert len(lora.host) == 2  # the host LRU holds max_cpu_loras


def test_prefix_cache_never_serves_one_adapters_kv_to_another(lora_setup):
    model_dir, hf_base, adapters = lora_setup
    llm = _llm(model_dir, max_loras=2, kvcache_block_size=8)
    engine = llm.llm_engine
    prompt = _prompts(1, length=40)[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    (a1, hf1), (a2, hf2) = adapters[0], adapters[1]
    runs = [(a1, hf1), (a2, hf2), (None, hf_base)]
    for lora, oracle in runs:
        hits = engine.stats().prefix_cache_hit_tokens
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == _hf_greedy(oracle, prompt)
        assert engine.stats().prefix_cache_hit_tokens == hits  # no cross-adapter hit
        assert out.num_cached_tokens == 0
    # The same adapter again hits its own blocks.
    out = llm.generate([prompt], params, use_tqdm=False, lora_request=a2)[0]
    assert out.num_cached_tokens == 32  # every full block but the last (it computes a token)
    assert out.outputs[0].token_ids == _hf_greedy(hf2, prompt)
    assert_idle(llm)
    # The cached blocks carry what the router computes from the spec: the model
    # id, and the adapter's digest as an extra key (none for the base model).
    cached = set(engine.cached_block_hashes().stored)
    name = engine.config.served_model_name
    for lora in (a1, a2, None):
        keys = (lora_extra_key(adapter_digest(lora)),) if lora else ()
        assert set(hash_prompt_blocks(prompt, name, 8, extra_keys=keys)) <= cached


def _copy_adapter(src: str, dst, edit=None):
    shutil.copytree(src, dst)
    if edit is not None:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    return str(dst)


def test_bad_adapters_and_requests_are_refused_with_the_reason(lora_setup, tmp_path):
    model_dir, _, adapters = lora_setup
    good = adapters[0][0]
    llm = _llm(model_dir)
    prompt = _prompts(1)[0]

    def refuse(lora, match):
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], SamplingParams(max_tokens=2), lora_request=lora)

    big = _copy_adapter(good.lora_path, tmp_path / "r16", lambda c: {**c, "r": 16})
    refuse(LoRARequest("r16", 8, big), "rank 16, above max_lora_rank 8")
    # Tensors that do not fit the config's rank or the model's projection shapes.
    other = _copy_adapter(good.lora_path, tmp_path / "r2", lambda c: {**c, "r": 2})
    refuse(LoRARequest("r2", 13, other), r"do not fit rank 2 .*another base model")
    lm_head = _copy_adapter(
        good.lora_path, tmp_path / "lm", lambda c: {**c, "target_modules": ["q_proj", "lm_head"]}
    )
    refuse(LoRARequest("lm", 9, lm_head), r"lacks.*\['lm_head'\]")
    dora = _copy_adapter(good.lora_path, tmp_path / "dora", lambda c: {**c, "use_dora": True})
    refuse(LoRARequest("dora", 10, dora), "use_dora")
    refuse(
        LoRARequest("gone", 11, str(tmp_path / "nowhere")), "adapter_config.json.*does not exist"
    )
    no_weights = _copy_adapter(good.lora_path, tmp_path / "nw")
    (tmp_path / "nw" / "adapter_model.safetensors").unlink()
    refuse(LoRARequest("nw", 12, no_weights), "adapter_model.safetensors.*does not exist")
    assert llm.llm_engine.add_lora(good)  # vLLM's: read and checked before any request
    assert llm.llm_engine.list_loras() == {good.lora_int_id}
    with pytest.raises(ValueError, match="use_dora"):
        llm.llm_engine.add_lora(LoRARequest("dora", 10, dora))
    llm.generate([prompt], SamplingParams(max_tokens=2), lora_request=good)
    refuse(LoRARequest("other", good.lora_int_id, adapters[1][0].lora_path), "lora_int_id 1 is")
    refuse([good, good], "2 lora_requests for 1 prompts")
    assert_idle(llm)
    base = LLM(str(model_dir), device="cpu", max_model_len=256, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="without enable_lora"):
        base.generate([prompt], SamplingParams(max_tokens=2), lora_request=good)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        _llm(model_dir, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        _llm(model_dir, max_lora_rank=7)
    with pytest.raises(ValueError, match="lora_int_id must be a positive"):
        LoRARequest("x", 0, "/tmp")


def test_tensor_parallel_shards_adapters_like_their_layers(lora_setup):
    model_dir, hf_base, adapters = lora_setup
    llm = _llm(model_dir, max_loras=3, tensor_parallel_size=2)
    try:
        _check_mixed_batch(llm, hf_base, adapters)
    finally:
        llm.llm_engine.shutdown()


def _run(engine, requests) -> dict[str, list[int]]:
    """Step the engine until it is idle; each request's final token ids."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert set(done) == set(requests)
    return done


def test_remove_lora_drains_its_requests_and_a_re_add_is_exact(lora_setup, tmp_path):
    """remove_lora while requests run under the adapter: they finish on its
    weights (its files deleted meanwhile), new work waits for no slot it
    held, and only then are its host copy and slot freed; re-added from the
    same files it hits its own cached KV, other files under its id are refused."""
    model_dir, _, adapters = lora_setup
    (a1, hf1), (a2, hf2) = adapters[0], adapters[1]
    path = _copy_adapter(a1.lora_path, tmp_path / "a1")
    lora1 = LoRARequest("a1", 1, path)
    llm = _llm(model_dir, max_loras=1, max_cpu_loras=1, max_num_seqs=2, kvcache_block_size=8,
               num_kvcache_blocks=64)  # fmt: skip
    engine, manager = llm.llm_engine, llm.llm_engine.model_runner.lora
    assert engine.add_lora(lora1, manager.read(lora1))  # read off the engine thread
    prompts = _prompts(4, length=24)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    for i in range(3):  # two run, one waits for a sequence slot
        engine.add_request(f"a1-{i}", prompts[i], params, lora_request=lora1)
    engine.step()
    assert engine.remove_lora(1) and engine.list_loras() == set()
    assert not engine.remove_lora(1) and not engine.remove_lora(99)
    assert engine.lora_requests_in_flight(1) == 3
    shutil.rmtree(path)  # in-flight requests never read the files again
    engine.add_request("a2", prompts[3], params, lora_request=a2)  # waits for the one slot
    assert set(manager.host) == {1, 2}  # over max_cpu_loras: the drained one is kept
    done = _run(engine, ["a1-0", "a1-1", "a1-2", "a2"])
    for i in range(3):
        assert done[f"a1-{i}"] == _hf_greedy(hf1, prompts[i]), i
    assert done["a2"] == _hf_greedy(hf2, prompts[3])
    assert set(manager.host) == {2} and not manager.removing
    assert 1 not in engine.scheduler.lora_slots.resident
    assert_idle(llm)
    with pytest.raises(ValueError, match="does not exist"):
        engine.add_lora(lora1)
    _copy_adapter(a1.lora_path, tmp_path / "a1")
    assert engine.add_lora(lora1) and engine.list_loras() == {1, 2}
    out = llm.generate([prompts[0]], params, use_tqdm=False, lora_request=lora1)[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf1, prompts[0])
    assert out.num_cached_tokens == 16  # its own KV, kept by the adapter's digest
    other = LoRARequest("a1-other", 1, a2.lora_path)
    assert engine.remove_lora(1)
    with pytest.raises(ValueError, match="differs from the files first read under that id"):
        engine.add_lora(other)
    assert engine.list_loras() == {2}
    assert_idle(llm)


# -- The host tier (swap_space): adapters across a swap and a host-tier hit -----
# One KV block of the tiny Llama in fp32 at block size 8: K and V x 2 layers x
# 8 tokens x 2 heads x 16.
_BLOCK_BYTES = 2 * 2 * 8 * 2 * 16 * 4


def _tiered(model_dir, num_blocks: int, **kwargs) -> LLM:
    from engine.device import GiB

    return _llm(model_dir, kvcache_block_size=8, num_kvcache_blocks=num_blocks,
                max_model_len=8 * num_blocks, swap_space=64 * _BLOCK_BYTES / GiB,
                **kwargs)  # fmt: skip


def _assert_tier_idle(llm) -> None:
    """Both tiers free and every adapter slot unused (the adapters may stay)."""
    assert_idle(llm)
    engine = llm.llm_engine
    engine.host_tier.check_invariants()
    assert engine.host_tier.num_free_slots == engine.host_tier.num_slots
    slots = engine.scheduler.lora_slots
    assert all(slots.users(i) == 0 for i in (1, 2, 3))
    assert len(slots.resident) <= slots.max_loras


def _slot_users_match(scheduler) -> bool:
    """Each adapter's slot has as many users as it has sequences running or
    loading; swapped and waiting ones hold none."""
    want: dict[int, int] = {}
    for seq in [*scheduler.running, *scheduler.loading.values()]:
        if seq.lora_request is not None:
            want[seq.lora_request.lora_int_id] = want.get(seq.lora_request.lora_int_id, 0) + 1
    return all(scheduler.lora_slots.users(i) == want.get(i, 0) for i in (1, 2, 3))


def test_swap_preemption_with_adapters_mixed_equals_hf_peft(lora_setup):
    """Three adapters and the base through two device slots in a 14-block pool:
    the first four 20-token prompts fill 12 blocks, and as they grow the
    newest are swapped to the host tier, giving their adapter's slot up;
    each takes a slot again before it loads back (slot users are checked
    after every step). Every output is HF + PEFT's for its prompt alone."""
    model_dir, hf_base, adapters = lora_setup
    llm = _tiered(model_dir, 14, max_loras=2, preemption_mode="swap")
    engine, scheduler = llm.llm_engine, llm.llm_engine.scheduler
    (a1, hf1), (a2, hf2), (a3, hf3) = adapters
    # The adapters' sequences are the newest of the first four: the victims.
    runs = [(None, hf_base), (a1, hf1), (a2, hf2), (a1, hf1), (a3, hf3), (None, hf_base),
            (a2, hf2), (a3, hf3)]  # fmt: skip
    prompts = _prompts(len(runs))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    for i, (prompt, (lora, _)) in enumerate(zip(prompts, runs, strict=True)):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    done: dict[str, list[int]] = {}
    swapped_adapters: set[int] = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        swapped_adapters |= {
            s.lora_request.lora_int_id for s in scheduler.swapped if s.lora_request
        }
        assert _slot_users_match(scheduler)
    for i, (prompt, (_, oracle)) in enumerate(zip(prompts, runs, strict=True)):
        assert done[str(i)] == _hf_greedy(oracle, prompt), i
    stats = engine.stats()
    assert swapped_adapters and stats.num_swap_fallbacks == 0
    assert stats.num_swap_preemptions == stats.num_preemptions > 0
    _assert_tier_idle(llm)


def test_a_host_tier_hit_never_crosses_adapters(lora_setup):
    """A second turn under adapter 1 whose first turn left the device pool for
    the host tier: adapter 2 and the base model, sending the very same
    tokens, get no hit there (block hashes carry the adapter's digest);
    adapter 1 loads its prefix back. Every output is HF + PEFT's."""
    model_dir, hf_base, adapters = lora_setup
    (a1, hf1), (a2, hf2) = adapters[0], adapters[1]
    llm = _tiered(model_dir, 11, max_loras=2)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    first = _prompts(1, length=40)[0]
    out = llm.generate([first], params, use_tqdm=False, lora_request=a1)[0]
    assert out.outputs[0].token_ids == _hf_greedy(hf1, first)
    second = first + list(out.outputs[0].token_ids) + [7] * 12
    # Two prompts of 10 blocks each, one after the other: every block of the
    # first turn leaves the 11-block pool (spilled to the host tier).
    for filler in _prompts(3, length=80)[1:]:
        llm.generate([filler], params.clone(max_tokens=1), use_tqdm=False)
    assert engine.host_tier.num_cached_slots >= 5  # the first turn's full blocks
    for lora, oracle in ((a2, hf2), (None, hf_base), (a1, hf1)):
        hits = engine.stats().host_tier_hit_blocks
        out = llm.generate([second], params, use_tqdm=False, lora_request=lora)[0]
        assert out.outputs[0].token_ids == _hf_greedy(oracle, second)
        if lora is a1:
            assert out.num_cached_tokens >= 5 * 8
            assert engine.stats().host_tier_hit_blocks >= hits + 5
        else:
            assert out.num_cached_tokens == 0
            assert engine.stats().host_tier_hit_blocks == hits
    _assert_tier_idle(llm)
