"""The host tier's copies on a real stream (engine/tier_copies.py): a spill reads
a block only after the steps queued before it wrote it, and before the next
step rewrites it; a load is reported only once it landed and holds no other
work up; and the engine's greedy outputs with the tier (spills, hits, swaps,
under async scheduling) equal those without it.
Run on a GPU host: ``python -m pytest tests/gpu -m gpu``."""

from __future__ import annotations

import time

import pytest
import torch

from engine import SamplingParams
from engine.host_tier import HostTier
from engine.tier_copies import TierCopier, TierTransfers
from tests.engine.test_host_tier import (
    conversations,
    make_llm,
    pressure_prompts,
    run_two_turns,
    slots,
)
from tests.unit.engine.helpers import make_seq

pytestmark = pytest.mark.gpu

SHAPE = (2, 3, 32, 16, 2, 64)  # [2, layers, blocks, block size, heads, head dim]
SPIN = 200_000_000  # cycles torch.cuda._sleep holds a stream (a good part of a second)


@pytest.fixture
def tiers():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kv = torch.randn(SHAPE, device="cuda")
    tier = HostTier(8)
    return kv, tier, TierTransfers(tier, TierCopier(kv, tier.num_slots))


def spill(tier: HostTier, block: int, tag: int) -> int:
    """Spill one block under hash ``tag``; its slot."""
    tier.spill(tag.to_bytes(16, "little"), bytes(16), (tag,) * SHAPE[3], block)
    return tier._hash_to_slot[tag.to_bytes(16, "little")]


def test_a_spill_reads_the_block_after_queued_writes_and_before_the_next(tiers):
    kv, tier, transfers = tiers
    torch.cuda._sleep(SPIN)  # a long step on the compute stream...
    kv[:, :, 5].fill_(7.0)  # ...that writes block 5 at its end
    slot5 = spill(tier, 5, 1)
    before3 = kv[:, :, 3].clone()
    with torch.cuda.stream(transfers.copier.stream):
        torch.cuda._sleep(SPIN)  # the copy stream is busy too
    slot3 = spill(tier, 3, 2)
    transfers.flush([])
    kv[:, :, 3].fill_(-1.0)  # the next step reuses block 3
    kv[:, :, 5].fill_(-1.0)
    transfers.poll(wait=True)
    assert torch.equal(transfers.copier.host[:, :, slot5], torch.full_like(before3, 7.0).cpu())
    assert torch.equal(transfers.copier.host[:, :, slot3], before3.cpu())
    tier.check_invariants()


def test_a_load_lands_before_it_is_reported_and_holds_no_step_up(tiers):
    kv, tier, transfers = tiers
    want = kv[:, :, 2].clone()
    slot = spill(tier, 2, 3)
    transfers.flush([])
    transfers.poll(wait=True)
    seq = make_seq(4)
    tier.hold([slot])
    tier.load([slot], [9])
    allocations = transfers.copier.staging.num_allocations
    with torch.cuda.stream(transfers.copier.stream):
        torch.cuda._sleep(SPIN * 8)
    # A pinned allocation here would wait for the spin (CUDA's implicit
    # synchronization): the load's staging comes from the copier's pool.
    transfers.flush([seq])
    assert transfers.copier.staging.num_allocations == allocations
    began = time.monotonic()
    x = torch.ones(64, device="cuda")
    (x * 2).sum().item()  # a step on the compute stream: not behind the load
    step_s = time.monotonic() - began
    assert transfers.poll() == []  # still copying: the sequence stays out
    assert transfers.poll(wait=True) == [seq]
    loaded_s = time.monotonic() - began
    assert step_s < loaded_s / 4, (step_s, loaded_s)
    # The copy in is timed on the copy stream from its start: the spin queued
    # before it is not in its seconds.
    assert 0 < tier.stats.seconds_to_device < loaded_s / 4, (tier.stats, loaded_s)
    assert torch.equal(kv[:, :, 9], want)
    tier.check_invariants()
    assert tier.num_free_slots == tier.num_slots


def test_engine_outputs_with_the_host_tier_equal_those_without(tiny_llama_dir):
    """The torch attention backend, as on the CPU; async scheduling (CUDA's default)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain = make_llm(tiny_llama_dir, num_blocks=16, device="cuda", attention_backend="torch")
    want, _ = run_two_turns(plain)
    tiered = make_llm(
        tiny_llama_dir,
        num_blocks=16,
        device="cuda",
        attention_backend="torch",
        swap_space=slots(64),
    )
    got, cached = run_two_turns(tiered)
    assert got == want and all(cached)
    assert tiered.llm_engine.stats().host_tier_hit_blocks >= 32

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    big = make_llm(tiny_llama_dir, num_blocks=64, device="cuda", attention_backend="torch")
    want = [o.outputs[0].token_ids for o in big.generate(pressure_prompts(), params)]
    swapping = make_llm(
        tiny_llama_dir,
        num_blocks=17,
        device="cuda",
        attention_backend="torch",
        swap_space=slots(64),
        preemption_mode="swap",
    )
    got = [o.outputs[0].token_ids for o in swapping.generate(pressure_prompts(), params)]
    assert got == want and swapping.llm_engine.stats().num_swap_preemptions > 0
    engine = swapping.llm_engine
    while engine.has_work():  # the last spills land
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.host_tier.num_free_slots == engine.host_tier.num_slots


def reservation_after_eviction(model_dir, device: str) -> None:
    """Decode node: a reservation whose prefix left the pool for the tier
    finds those blocks holding the tier's KV when ``reserve_request`` returns
    (a transfer then writes the rest on a stream of its own, and the first
    step reads them), even behind a busy copy stream."""
    llm = make_llm(
        model_dir, num_blocks=16, device=device, attention_backend="torch", swap_space=slots(64)
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    firsts = conversations(4)  # 6 blocks each: the last two evict the first's
    for prompt in firsts:
        llm.generate([prompt], params, use_tqdm=False)
    transfers = engine.tier_transfers
    if transfers.copier.stream is not None:
        with torch.cuda.stream(transfers.copier.stream):
            torch.cuda._sleep(SPIN)
    res = engine.reserve_request("r", firsts[0] + [3] * 8, params)
    assert res is not None and res.first_block == 4
    assert engine.host_tier.stats.hit_blocks == 4 and not transfers.busy
    hashes = engine.requests["r"].seqs[0].block_hashes[:4]
    kv = transfers.copier.kv_cache
    for block, block_hash in zip(res.block_ids[:4], hashes, strict=True):
        slot = engine.host_tier._hash_to_slot[block_hash]
        assert torch.equal(kv[:, :, block].cpu(), transfers.copier.host[:, :, slot])
    engine.abort_request("r")
    engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.host_tier.num_free_slots == engine.host_tier.num_slots


def test_a_reservation_finds_its_host_tier_hits_copied_in_when_it_returns(tiny_llama_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reservation_after_eviction(tiny_llama_dir, "cuda")


@pytest.mark.multi_gpu
def test_tp2_engine_outputs_with_the_host_tier_equal_tp1_without_it(tiny_llama_dir):
    """Two GPUs, one KV head each: every rank spills, loads and swaps its heads
    of the same blocks on its own pinned memory and copy stream (async
    scheduling), retiring them in step with rank 0; the greedy tokens equal
    TP = 1's without a tier, and both tiers are free at idle."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    plain = make_llm(tiny_llama_dir, num_blocks=64, device="cuda", attention_backend="torch")
    want_turns, _ = run_two_turns(plain)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(pressure_prompts(), params)]
    tp2 = make_llm(
        tiny_llama_dir,
        num_blocks=16,
        device="cuda",
        attention_backend="torch",
        swap_space=slots(64) / 2,  # per rank: each holds half of every block
        preemption_mode="swap",
        tensor_parallel_size=2,
    )
    try:
        got_turns, cached = run_two_turns(tp2)
        assert got_turns == want_turns and all(cached)
        got = [o.outputs[0].token_ids for o in tp2.generate(pressure_prompts(), params)]
        engine = tp2.llm_engine
        assert got == want and engine.stats().num_swap_preemptions > 0
        assert engine.stats().host_tier_hit_blocks >= 32
        while engine.has_work():  # the last spills land
            engine.step()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert engine.host_tier.num_free_slots == engine.host_tier.num_slots
    finally:
        tp2.llm_engine.shutdown()
