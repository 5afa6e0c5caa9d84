"""The prefill/decode hand-off at the engine level, with an in-process (loopback) transfer.

The same hand-off between processes over real gloo channels is in tests/integration.
"""

from __future__ import annotations

import pytest

from common.kv_transfer.loopback import loopback_transfer
from engine import LLM, RequestOutputKind, SamplingParams
from tests.engine.conftest import assert_idle

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def quicksort(xs):\n    ",
    "Three facts about the Moon:",
]


@pytest.fixture(scope="module")
def prefill_llm(demo_model_dir):
    return LLM(str(demo_model_dir), max_model_len=1024, device="cpu", kvcache_block_size=16)


@pytest.fixture(scope="module")
def decode_llm(demo_model_dir):
    return LLM(str(demo_model_dir), max_model_len=1024, device="cpu", kvcache_block_size=16)


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What a prefill node runs: just the first token."""
    return params.clone(
        max_tokens=1,
        min_tokens=min(params.min_tokens, 1),
        stop=None,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def run_until_finished(engine, request_id):
    final = None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def disaggregated(prefill, decode, request_id, prompt_ids, params):
    p, d = prefill.llm_engine, decode.llm_engine
    res = d.reserve_request(request_id, prompt_ids, params)
    assert res is not None
    p.add_request(request_id, prompt_ids, prefill_params(params), hold_kv=True)
    first = run_until_finished(p, request_id)
    seq = p.take_held(request_id)
    assert seq is not None and len(seq.block_table) == len(res.block_ids)
    loopback_transfer(
        p.model_runner, seq.block_table[res.first_block :], d.model_runner, res.blocks_to_fill
    )
    p.release_held(request_id)
    c = first.outputs[0]
    lp = None
    if params.logprobs is not None:
        from engine.sequence import TokenLogprobs

        entry = c.logprobs[0][c.token_ids[0]]
        lp = TokenLogprobs(entry.logprob, entry.rank, [], [])
    d.commit_request(request_id, c.token_ids[0], lp, cached_tokens=first.num_cached_tokens)
    return res, run_until_finished(d, request_id)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=1),
    ],
    ids=["greedy", "seeded", "one-token"],
)
def test_handoff_gives_the_single_node_output(prefill_llm, decode_llm, demo_tokenizer, params):
    for i, text in enumerate(PROMPTS):
        ids = demo_tokenizer.encode(text)
        (single,) = decode_llm.generate([ids], params)
        _, out = disaggregated(
            prefill_llm, decode_llm, f"h-{params.seed}-{params.max_tokens}-{i}", ids, params
        )
        assert out.outputs[0].token_ids == single.outputs[0].token_ids
        assert out.outputs[0].text == single.outputs[0].text
        assert out.outputs[0].finish_reason == single.outputs[0].finish_reason
        m = out.metrics  # the committed request was scheduled, then gave its first token
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert_idle(prefill_llm)
    assert_idle(decode_llm)


def test_decode_prefix_cache_shrinks_the_transfer(prefill_llm, decode_llm, demo_tokenizer):
    ids = demo_tokenizer.encode(
        "A long shared system prompt about libraries and their opening hours. " * 3
    )
    params = SamplingParams(temperature=0, max_tokens=8)
    res1, _ = disaggregated(prefill_llm, decode_llm, "pc-1", ids + [42], params)
    res2, out2 = disaggregated(prefill_llm, decode_llm, "pc-2", ids + [43], params)
    assert res1.first_block == 0
    assert res2.first_block == len(ids) // 16  # the decode node already held the shared prefix
    assert len(res2.blocks_to_fill) < len(res1.blocks_to_fill)
    (single,) = decode_llm.generate([ids + [43]], params)
    assert out2.outputs[0].token_ids == single.outputs[0].token_ids
    assert out2.num_cached_tokens > 0  # the prefill node's own cache served the prefix too
    assert_idle(decode_llm)


def test_aborts_free_reserved_and_held_blocks(prefill_llm, decode_llm, demo_tokenizer):
    p, d = prefill_llm.llm_engine, decode_llm.llm_engine
    ids = demo_tokenizer.encode("Abort me before my KV arrives, please.")
    params = SamplingParams(temperature=0, max_tokens=4)
    free = d.block_manager.num_free_blocks
    assert d.reserve_request("ab-1", ids, params) is not None
    assert d.block_manager.num_free_blocks < free
    d.abort_request("ab-1")
    assert d.block_manager.num_free_blocks == free
    p.add_request("ab-2", ids, prefill_params(params), hold_kv=True)
    run_until_finished(p, "ab-2")
    assert p.take_held("ab-2") is not None and p.block_manager.num_used_blocks > 0
    p.abort_request("ab-2")  # the decode side gave up before the transfer
    assert p.take_held("ab-2") is None
    d.step()  # collect the abort output
    assert_idle(prefill_llm)
    assert_idle(decode_llm)
    with pytest.raises(KeyError):
        d.commit_request("ab-1", 5)


def test_reservation_refused_when_blocks_run_out(demo_model_dir, demo_tokenizer):
    small = LLM(
        str(demo_model_dir),
        max_model_len=64,
        device="cpu",
        kvcache_block_size=16,
        num_kvcache_blocks=4,
    )
    ids = demo_tokenizer.encode("word " * 40)[:40]  # 3 blocks
    engine = small.llm_engine
    assert engine.reserve_request("a", ids, SamplingParams(max_tokens=2)) is not None
    assert (
        engine.reserve_request("b", ids[::-1], SamplingParams(max_tokens=2)) is None
    )  # 1 block left
    assert "b" not in engine.requests
    with pytest.raises(ValueError, match="n = 1"):
        engine.reserve_request("c", ids, SamplingParams(n=2))
    engine.abort_request("a")
    engine.step()
    assert_idle(small)
