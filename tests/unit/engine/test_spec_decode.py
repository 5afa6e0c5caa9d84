"""Speculative decoding's host side: config validation, n-gram lookup, the
scheduler's verify rows and KV rollback, and acceptance sampling that keeps
the target distribution (a statistical test of the real sampler)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.block_manager import BlockManager
from engine.layers.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.speculator import Speculator, num_accepted
from tests.unit.engine.helpers import make_seq

BS = 4


# ------------------------------------------------------------------ config
def test_vllm_forms_and_older_names_parse():
    c = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert c.method is SpeculativeMethod.NGRAM
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    d = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (d.prompt_lookup_min, d.prompt_lookup_max) == (5, 5)
    old = SpeculativeConfig.parse(
        {
            "speculative_model": "[ngram]",
            "num_speculative_tokens": 5,
            "ngram_prompt_lookup_max": 3,
            "ngram_prompt_lookup_min": 1,
            "speculative_disable_by_batch_size": 4,
        }
    )
    assert old.to_dict() == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": 4,
    }
    assert SpeculativeConfig.parse(old.to_dict()) == old


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens must be in"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"num_speculative_tokens": 2}, "method is required"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model .* is required"),
        (
            {"method": "draft_model", "model": "/no/such/dir", "num_speculative_tokens": 2},
            "is not a directory",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min \\(4\\) must be <= prompt_lookup_max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, ">= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ">= 2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown speculative_config"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


# ------------------------------------------------------------------- n-gram
def test_ngram_proposes_the_latest_continuation_of_the_longest_suffix():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    # The 2-token suffix (7, 8) recurs at two places: the latest wins.
    assert p.propose([7, 8, 1, 9, 7, 8, 2, 5, 7, 8], 2) == [2, 5]
    # Only a 1-token suffix recurs; capped at what follows it.
    assert p.propose([5, 1, 2, 9, 9], 4) == [9]
    assert p.propose([1, 2, 3, 4, 5], 2) == []
    assert NgramProposer(3, 3).propose([1, 2, 9, 1, 2], 2) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# ---------------------------------------------------------- scheduling / KV
def make_sched(budget=64, num_blocks=32):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=True)
    return Scheduler(bm, 8, budget, 256)


def decode_ready(sched, prompt):
    seq = make_seq(prompt, BS)
    sched.add(seq)
    batch = sched.schedule()
    sched.update(batch, [7] * len(batch.seqs))
    return seq


def test_verify_rows_count_only_accepted_tokens_and_roll_back_blocks():
    sched = make_sched()
    config = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    )
    spec = Speculator(config, 256, sched.block_manager)
    seq = decode_ready(sched, [9, 1, 2, 3, 7, 1, 2, 4])  # then 7 was sampled
    seq.token_ids[-1] = 3  # ... 3 7 1 2 4 3 -> lookup proposes 7 1 2 4
    spec.propose(sched.running)
    assert seq.spec_token_ids == [7, 1, 2, 4]
    batch = sched.schedule()
    assert batch.num_new_tokens == [5] and batch.sampling_rows() == [0]
    blocks_during = len(seq.block_table)
    assert blocks_during == sched.block_manager.blocks_needed(8 + 5) == 4
    placeholders = sched.advance(batch)
    assert seq.num_computed_tokens == 9 and placeholders == [(0, seq)]
    # The target sampled 7, 1, then 9 where the proposal said 2: keeps 7, 1, emits 9.
    samples = [7, 1, 9, 0, 0]
    drafts, seq.spec_token_ids = seq.spec_token_ids, []
    seq.token_ids[-1] = samples[0]
    emitted = []
    n = spec.accept(seq, drafts, samples, [None] * 5, 0, lambda s, t, lp: emitted.append(t))
    assert n == 2 and emitted == [1, 9]
    assert seq.token_ids[8:] == [3, 7, 1, 9]
    assert seq.num_computed_tokens == 11  # up to the kept 1; 9 is next step's input
    assert len(seq.block_table) == sched.block_manager.blocks_needed(12) == 3
    # Only blocks wholly within verified, computed tokens are in the cache.
    assert seq.num_cached_blocks == 2
    sched.block_manager.check_invariants()
    st = spec.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (1, 4, 2)
    assert st.acceptance_per_position() == [1.0, 1.0, 0.0, 0.0]
    assert st.mean_acceptance_length == 3.0


def test_proposals_respect_max_tokens_budget_and_batch_size():
    sched = make_sched()
    config = SpeculativeConfig.parse(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "disable_by_batch_size": 3,
        }
    )
    spec = Speculator(config, 256, sched.block_manager)
    a = decode_ready(sched, [1, 2, 3, 1, 2])  # then 7
    a.token_ids[-1] = 3
    a.params = SamplingParams(max_tokens=3)  # 1 emitted: a step may add 2 -> 1 proposed
    spec.propose(sched.running)
    assert a.spec_token_ids == [1]
    a.params = SamplingParams()
    spec.propose(sched.running)
    assert a.spec_token_ids == [1, 2, 3]
    sched.max_num_batched_tokens = 3
    batch = sched.schedule()  # budget 3: the token and 2 proposed
    assert batch.num_new_tokens == [3] and a.spec_token_ids == [1, 2]
    a.spec_token_ids = []
    b = make_seq([4, 4, 4], BS)
    c = make_seq([5, 5, 5], BS)
    for s in (b, c):
        sched.running.append(s)
    spec.propose(sched.running)  # 3 running: disabled
    assert not a.spec_token_ids
    sched.running.remove(c)
    a.params = SamplingParams(disable_spec_decode=True)  # the request opted out
    spec.propose(sched.running)
    assert not a.spec_token_ids
    a.params = SamplingParams()
    spec.propose(sched.running)
    assert a.spec_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="disable_spec_decode must be a bool"):
        SamplingParams(disable_spec_decode=1)


def test_acceptance_keeps_the_target_distribution():
    """A proposal [d0, d1] checked by sampling each position: the first emitted
    token follows p0, d0 is kept with probability p0(d0), and the token after a
    kept d0 follows p1. 40k sequences in one sampler call."""
    vocab, n = 5, 40_000
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.5, 0.1])
    d0, d1 = 1, 0
    logits = torch.stack([p0.log(), p1.log()]).repeat(n, 1)  # rows 2i, 2i + 1
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, [0], 1, None, [])] * (2 * n)
    sampler = Sampler(vocab, torch.device("cpu"), seed=1234)
    samples = sampler.sample(logits, rows).token_ids.tolist()
    first, second = [], []
    for i in range(n):
        s = samples[2 * i : 2 * i + 2]
        k = num_accepted([d0, d1], s, 0)
        first.append(s[0])  # the token emitted at position 0 (d0 when kept)
        if k >= 1:
            second.append(s[1])
    chi_first = chi_square(first, p0)
    chi_second = chi_square(second, p1)
    # 4 degrees of freedom: P(chi2 > 18.5) < 0.001.
    assert chi_first < 18.5 and chi_second < 18.5
    kept = len(second) / n
    assert abs(kept - p0[d0].item()) < 4 * (0.4 * 0.6 / n) ** 0.5


def test_rejection_sampling_of_draft_probabilities_keeps_the_target_distribution():
    """A draft's sampled proposal [d0, d1] (d_i ~ q_i): the first emitted token
    follows p0 whatever q0, d0 is kept with probability sum(min(p0, q0)), and
    after a kept d0 the next token follows p1. 40k sequences in one call."""
    from engine.spec_decode.rejection import DraftProbs

    vocab, n = 5, 40_000
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.05, 0.05, 0.5, 0.1]])
    q = torch.tensor([[0.3, 0.3, 0.1, 0.05, 0.25], [0.1, 0.1, 0.6, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # [n, 2]
    logits = p.log().repeat(n, 1)  # rows 2i, 2i + 1
    rows = [SamplingRow(SamplingParams(temperature=1.0), [0], 1, None, [])] * (2 * n)
    proposed = DraftProbs(torch.arange(2 * n), drafts.reshape(-1), q.repeat(n, 1), [None] * (2 * n))
    sampler = Sampler(vocab, torch.device("cpu"), seed=1234)
    samples = sampler.sample(logits, rows, None, proposed).token_ids.tolist()
    first, second = [], []
    for i in range(n):
        s = samples[2 * i : 2 * i + 2]
        k = num_accepted(drafts[i].tolist(), s, 0)
        first.append(s[0])
        if k >= 1:
            second.append(s[1])
    # 4 degrees of freedom: P(chi2 > 18.5) < 0.001.
    assert chi_square(first, p[0]) < 18.5 and chi_square(second, p[1]) < 18.5
    kept = torch.minimum(p[0], q[0]).sum().item()
    assert abs(len(second) / n - kept) < 4 * (kept * (1 - kept) / n) ** 0.5
    # Without the rejection rule (kept iff the target's own sample agrees) the
    # first token would still follow p0 but far fewer proposals would be kept.
    assert len(second) / n > (p[0] * q[0]).sum().item() + 0.1


def chi_square(tokens: list[int], p: torch.Tensor) -> float:
    counts = np.bincount(np.asarray(tokens), minlength=len(p))
    expected = p.numpy() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


# ------------------------------------------------------ engine combinations
def engine_config(tmp_path, kind="llama", **kwargs):
    from engine.config import EngineConfig
    from tests.conftest import TINY_CONFIGS, write_config_dir

    model = write_config_dir(tmp_path / kind, TINY_CONFIGS[kind])
    return EngineConfig.from_kwargs(str(model), **kwargs)


def test_what_speculation_cannot_be_combined_with_is_refused(tmp_path):
    from tests.conftest import TINY_CONFIGS, write_config_dir

    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    config = engine_config(tmp_path, speculative_config=ngram)
    assert config.speculative_config.method is SpeculativeMethod.NGRAM
    assert "speculative_config" in config.to_json()
    with pytest.raises(ValueError, match="async_scheduling=True cannot be combined"):
        engine_config(tmp_path, speculative_config=ngram, async_scheduling=True)
    # Under tensor parallelism: n-gram, and a draft that splits over the same ranks.
    assert engine_config(tmp_path, speculative_config=ngram, tensor_parallel_size=2)
    draft = {"method": "draft_model", "model": str(tmp_path / "llama"), "num_speculative_tokens": 2}
    assert engine_config(tmp_path, speculative_config=draft, tensor_parallel_size=2)
    # vLLM's draft_tensor_parallel_size (and its older name): the target's size only.
    same = dict(draft, draft_tensor_parallel_size=2)
    config = engine_config(tmp_path, speculative_config=same, tensor_parallel_size=2)
    assert config.speculative_config.draft_tensor_parallel_size == 2
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 1 is not supported"):
        engine_config(
            tmp_path,
            speculative_config=dict(draft, speculative_draft_tensor_parallel_size=1),
            tensor_parallel_size=2,
        )
    with pytest.raises(ValueError, match="draft_tensor_parallel_size is for method 'draft_model'"):
        engine_config(tmp_path, speculative_config=dict(ngram, draft_tensor_parallel_size=1))
    one_head = write_config_dir(
        tmp_path / "one-head",
        dict(TINY_CONFIGS["llama"], num_attention_heads=1, num_key_value_heads=1),
    )
    with pytest.raises(ValueError, match="runs with the target's tensor_parallel_size"):
        engine_config(
            tmp_path,
            speculative_config=dict(draft, model=str(one_head)),
            tensor_parallel_size=2,
        )
    # LoRA combines with either method (the draft proposes without the adapter).
    assert engine_config(tmp_path, speculative_config=ngram, enable_lora=True).enable_lora
    assert engine_config(tmp_path, speculative_config=draft, enable_lora=True).enable_lora
    # With a host tier (and swap preemption) it is served: tests/engine/test_host_tier.py.
    tiered = engine_config(tmp_path, speculative_config=ngram, swap_space=0.01,
                           preemption_mode="swap")  # fmt: skip
    assert tiered.swap_space == 0.01 and tiered.speculative_config is not None
    with pytest.raises(ValueError, match="every layer slides"):
        engine_config(tmp_path, "mistral", speculative_config=draft)


def test_verifying_rows_follow_the_plain_decodes():
    sched = make_sched()
    seqs = [decode_ready(sched, [i, 2, 3, 4]) for i in range(3)]
    seqs[0].spec_token_ids = [5, 6]
    batch = sched.schedule()
    assert batch.seqs == [seqs[1], seqs[2], seqs[0]]
    assert batch.num_new_tokens == [1, 1, 3]


def test_a_draft_catch_up_is_cut_into_forwards_of_the_step_budget():
    from engine.spec_decode.draft_model import pack_pieces

    # One forward while it fits (the usual case).
    assert pack_pieces([3, 1, 2], 8) == [[(0, 0, 3), (1, 0, 1), (2, 0, 2)]]
    # Whole prompts beyond the budget: split in order, a long one over several.
    got = pack_pieces([5, 12, 1], 8)
    assert got == [[(0, 0, 5), (1, 0, 3)], [(1, 3, 8)], [(1, 11, 1), (2, 0, 1)]]
    assert all(sum(n for _, _, n in f) <= 8 for f in got)
