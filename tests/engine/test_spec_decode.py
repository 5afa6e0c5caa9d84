"""Speculative decoding (n-gram prompt lookup) against the same engine without it.

Greedy outputs must be token for token the non-speculative ones, with the
proposals demonstrably accepted (the prompts repeat themselves, so lookup
pays); stops inside an accepted run cut it exactly; a seeded sampled request
is reproducible and matches the non-speculative stream (its generator is
rewound to one draw per emitted token); no prefix-cache block ever holds a
proposed token the target did not keep.
"""

from __future__ import annotations

import json
import re
from itertools import pairwise

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import assert_idle, perturbed_copy
from tests.engine.test_disaggregation import disaggregated

# Text the model is asked to repeat: prompt lookup finds its continuation.
REPEAT_PROMPTS = [
    "one two three four five six seven eight nine ten one two three four five six",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
]
TINY_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 2,
}
# A random model's greedy text soon loops: lookup pays on it too.
TINY_PROMPTS = [{"prompt_token_ids": [5 + i, 17, 3, 99, 5 + i, 17, 3]} for i in range(3)]


def completions(outs):
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs
    ]


@pytest.fixture(scope="module")
def demo_spec(demo_model_dir):
    return LLM(
        str(demo_model_dir),
        max_model_len=512,
        num_kvcache_blocks=256,
        device="cpu",
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )


def test_demo_model_greedy_stops_and_logprobs_equal_non_speculative(demo_spec, demo_llm):
    spec = demo_spec
    before = spec.llm_engine.stats().spec_decode.copy()
    assert not spec.llm_engine.async_scheduling
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    (ref,) = demo_llm.generate([REPEAT_PROMPTS[0]], base)
    tokens, text = ref.outputs[0].token_ids, ref.outputs[0].text
    stop_id = tokens[4]
    stop_str = text[len(text) // 2 : len(text) // 2 + 4]
    params = [
        base.clone(max_tokens=16),
        base.clone(stop_token_ids=[stop_id]),
        base.clone(stop=[stop_str]),
        base.clone(max_tokens=3),
        base.clone(min_tokens=9, stop_token_ids=[stop_id]),
    ]
    prompts = [REPEAT_PROMPTS[1]] + [REPEAT_PROMPTS[0]] * 4
    expected = demo_llm.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert completions(got) == completions(expected)
    for r, g in zip(expected, got, strict=True):
        for a, b in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert got[1].outputs[0].token_ids == tokens[: tokens.index(stop_id) + 1]
    assert len(got[3].outputs[0].token_ids) == 3
    assert len(got[4].outputs[0].token_ids) >= 9
    stats = spec.llm_engine.stats().spec_decode
    assert stats.num_accepted_tokens - before.num_accepted_tokens > 10  # it happened, and paid
    assert stats.mean_acceptance_length > 1.0
    per_pos = stats.acceptance_per_position()
    assert len(per_pos) == 4 and all(a >= b for a, b in pairwise(per_pos))
    assert_idle(spec)


def test_structured_requests_speculate_within_their_grammar(demo_spec, demo_llm):
    """Proposals are cut at the first token the grammar rejects and every
    verified position is sampled under its own mask: greedy output is the
    non-speculative one, grammar-valid, and proposals were both kept and cut."""
    pytest.importorskip("xgrammar")
    from engine.sampling_params import StructuredOutputsParams as S

    record = '{"name": "Ada", "age": 7}'
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    regex = r"(one two three ){2,4}four"
    prompts = [
        f"Copy the record exactly. {record} {record} {record}",
        "one two three one two three one two three one two three",
        "Is it red, green or blue? red green blue red green",
    ]
    base = SamplingParams(temperature=0, max_tokens=24)
    params = [
        base.clone(structured_outputs=S(json=schema, disable_any_whitespace=True)),
        base.clone(structured_outputs=S(regex=regex)),
        base.clone(structured_outputs=S(choice=["red green blue", "red green", "blue"])),
    ]
    engine = demo_spec.llm_engine
    speculator = engine.speculator
    checked: list[tuple[int, int]] = []  # (proposed, allowed)

    def check(seq, tokens):
        allowed = engine.structured.valid_prefix(seq, tokens)
        checked.append((len(tokens), allowed))
        return allowed

    before = engine.stats().spec_decode.copy()
    speculator.grammar_check = check
    try:
        got = demo_spec.generate(prompts, params, use_tqdm=False)
    finally:
        speculator.grammar_check = engine.structured.valid_prefix
    expected = demo_llm.generate(prompts, params, use_tqdm=False)
    assert completions(got) == completions(expected)
    json_out, regex_out, choice_out = (o.outputs[0] for o in got)
    parsed = json.loads(json_out.text)
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)
    assert re.fullmatch(regex, regex_out.text)
    assert choice_out.text in ("red green blue", "red green", "blue")
    assert all(o.finish_reason == "stop" for o in (json_out, regex_out, choice_out))
    assert any(allowed < proposed for proposed, allowed in checked)  # some were cut
    stats = engine.stats().spec_decode
    assert stats.num_accepted_tokens > before.num_accepted_tokens  # and some kept
    assert engine.num_grammar_matchers == 0
    assert_idle(demo_spec)


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir):
    # A small pool: the per-step block checks below walk all of it.
    kwargs = dict(
        skip_tokenizer_init=True, device="cpu", max_model_len=256, seed=0, num_kvcache_blocks=128
    )
    plain = LLM(str(tiny_llama_dir), **kwargs)
    spec = LLM(str(tiny_llama_dir), speculative_config=TINY_SPEC, **kwargs)
    return plain, spec


def test_tiny_model_greedy_and_seeded_equal_non_speculative(tiny_pair):
    plain, spec = tiny_pair
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    before = spec.llm_engine.stats().spec_decode.num_accepted_tokens
    got = spec.generate(TINY_PROMPTS, greedy)
    assert completions(got) == completions(plain.generate(TINY_PROMPTS, greedy))
    assert spec.llm_engine.stats().spec_decode.num_accepted_tokens > before
    seeded = [
        SamplingParams(temperature=1.0, seed=11 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(TINY_PROMPTS))
    ]
    seeded[1] = seeded[1].clone(top_k=5, repetition_penalty=1.2)
    first = spec.generate(TINY_PROMPTS, seeded)
    # Alone, in another order: the same tokens (they depend on the seed only).
    again = [
        spec.generate([p], s)[0] for p, s in zip(TINY_PROMPTS[::-1], seeded[::-1], strict=True)
    ][::-1]
    assert completions(first) == completions(again)
    assert completions(first) == completions(plain.generate(TINY_PROMPTS, seeded))
    assert_idle(spec)


def test_no_cached_block_holds_an_unverified_token(tiny_pair):
    _, spec = tiny_pair
    engine = spec.llm_engine
    bm = engine.block_manager
    bs = bm.block_size
    before = engine.stats().spec_decode.copy()
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("cache", TINY_PROMPTS[0], params)
    seq = engine.requests["cache"].seqs[0]
    while engine.has_work():
        engine.step()
        # Every block the cache registered holds the sequence's tokens as emitted.
        for i, block_id in enumerate(seq.block_table[: seq.num_cached_blocks]):
            assert bm.blocks[block_id].token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
        if not seq.is_finished:  # rejected positions' blocks went back
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens)
        bm.check_invariants()
    after = engine.stats().spec_decode
    proposed = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < proposed  # both kept and rejected proposals were seen
    # The finished sequence's full blocks are all in the cache, with its tokens.
    for i in range(seq.num_computed_tokens // bs):
        block_hash = seq.block_hashes[i]
        block = bm.blocks[bm._hash_to_block[block_hash]]
        assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])
    assert_idle(spec)


def test_a_remotely_prefilled_request_speculates_on_the_decode_engine(tiny_pair):
    """The decode node's path: KV reserved, streamed in from a prefill engine,
    committed with its first token; then verify steps there."""
    plain, spec = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    prompt = TINY_PROMPTS[1]["prompt_token_ids"]
    (ref,) = plain.generate([{"prompt_token_ids": prompt}], params)
    before = spec.llm_engine.stats().spec_decode.num_accepted_tokens
    _, out = disaggregated(plain, spec, "remote-spec", prompt, params)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert spec.llm_engine.stats().spec_decode.num_accepted_tokens > before
    assert_idle(spec)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_migrated_stream_continues_exactly_on_a_speculating_decode_engine(tiny_pair, sampling):
    """router/migration.py's continuation (prompt + the tokens so far,
    resume_offset = their count, max_tokens reduced) prefilled on a plain
    engine and decoded on a speculating one: the rest of the undisturbed
    non-speculative stream, token for token, with proposals kept (the lookup
    sees the tokens generated before the move as part of the prompt)."""
    plain, spec = tiny_pair
    total, moved = 40, 9
    params = SamplingParams(
        temperature=0, max_tokens=total, ignore_eos=True, detokenize=False, repetition_penalty=1.1
    )
    if sampling == "seeded":
        # Four allowed tokens: sampled text repeats, so lookup proposals get kept.
        params = params.clone(
            temperature=1.0,
            seed=23,
            top_k=3,
            frequency_penalty=0.2,
            allowed_token_ids=[7, 19, 23, 42],
        )
    prompt = TINY_PROMPTS[0]["prompt_token_ids"]
    (whole,) = plain.generate([{"prompt_token_ids": prompt}], params)
    whole = list(whole.outputs[0].token_ids)
    rest = params.clone(max_tokens=total - moved, resume_offset=moved)
    before = spec.llm_engine.stats().spec_decode.num_accepted_tokens
    _, out = disaggregated(plain, spec, f"moved-{sampling}", prompt + whole[:moved], rest)
    assert list(out.outputs[0].token_ids) == whole[moved:]
    assert spec.llm_engine.stats().spec_decode.num_accepted_tokens > before
    assert_idle(spec)


# ------------------------------------------------------------- draft model
def draft_llm(target_dir, draft_dir, k=3):
    return LLM(
        str(target_dir),
        skip_tokenizer_init=True,
        device="cpu",
        max_model_len=256,
        seed=0,
        num_kvcache_blocks=128,
        speculative_config={"method": "draft_model", "model": str(draft_dir),
                            "num_speculative_tokens": k},
    )  # fmt: skip


@pytest.fixture(scope="module")
def perturbed_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with noise on its MLPs: a draft that mostly agrees."""
    return perturbed_copy(tiny_llama_dir, tmp_path_factory.mktemp("perturbed"))


def test_draft_model_greedy_equals_non_speculative(tiny_pair, tiny_llama_dir, perturbed_dir):
    plain, _ = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    ref = completions(plain.generate(TINY_PROMPTS, params))
    # The model drafting for itself: every proposed token is kept.
    same = draft_llm(tiny_llama_dir, tiny_llama_dir)
    assert completions(same.generate(TINY_PROMPTS, params)) == ref
    stats = same.llm_engine.stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0
    assert_idle(same)
    del same
    # A perturbed copy: some kept, some rejected, the same output.
    other = draft_llm(tiny_llama_dir, perturbed_dir, k=4)
    assert completions(other.generate(TINY_PROMPTS, params)) == ref
    stats = other.llm_engine.stats().spec_decode
    assert 0.0 < stats.acceptance_rate < 1.0
    # Its prompt's draft KV is computed on the decode engine for a remote prefill.
    prompt = TINY_PROMPTS[2]["prompt_token_ids"]
    _, out = disaggregated(plain, other, "remote-draft", prompt, params)
    assert out.outputs[0].token_ids == ref[2][0][0]
    assert_idle(other)


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from tests.conftest import TINY_CONFIGS, write_config_dir

    other = write_config_dir(tmp_path / "draft", dict(TINY_CONFIGS["llama"], vocab_size=1000))
    with pytest.raises(ValueError, match=r"vocabulary \(1000 tokens\) does not match"):
        draft_llm(tiny_llama_dir, other)


def test_draft_model_sampling_keeps_the_target_distribution(tiny_llama_dir, perturbed_dir):
    """Temperature 1 within four allowed tokens, a perturbed draft sampling its
    proposals: the joint distribution of the first two output tokens (the
    second decided by rejection sampling against the draft's probabilities)
    is the target's, computed exactly with HF transformers."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    allowed = [7, 19, 23, 42]
    prompt = TINY_PROMPTS[0]["prompt_token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), torch_dtype=torch.float32)

    def dist(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1, allowed]
        return torch.softmax(logits.double(), dim=-1).numpy()

    p0 = dist(prompt)
    joint = np.stack([p0[a] * dist(prompt + [allowed[a]]) for a in range(4)]).reshape(-1)
    llm = draft_llm(tiny_llama_dir, perturbed_dir, k=2)
    params = SamplingParams(
        temperature=1.0, max_tokens=3, allowed_token_ids=allowed, ignore_eos=True, detokenize=False
    )
    n = 800
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    cells = [allowed.index(t0) * 4 + allowed.index(t1) for t0, t1, _ in
             (o.outputs[0].token_ids for o in outs)]  # fmt: skip
    counts = np.bincount(cells, minlength=16)
    chi2 = float(((counts - n * joint) ** 2 / (n * joint)).sum())
    assert chi2 < 37.7  # 15 degrees of freedom: P(chi2 > 37.7) < 0.001
    stats = llm.llm_engine.stats().spec_decode
    assert stats.num_draft_tokens >= n and 0.0 < stats.acceptance_rate < 1.0
    # Seeded requests are reproducible: together or alone, the same tokens.
    seeded = [params.clone(seed=s, max_tokens=8) for s in (5, 6, 7)]
    together = llm.generate([{"prompt_token_ids": prompt}] * 3, seeded, use_tqdm=False)
    alone = [llm.generate([{"prompt_token_ids": prompt}], s, use_tqdm=False)[0] for s in seeded]
    assert completions(together) == completions(alone)
    assert len({tuple(o.outputs[0].token_ids) for o in together}) > 1
    assert_idle(llm)
