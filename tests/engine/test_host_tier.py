"""The host tier end to end (swap_space, preemption_mode="swap") on a tiny
Llama with random weights (HF's initialisation from its config, a fixed seed:
tests/conftest.py's ``tiny_model``), on the CPU, where the "device" pool and
the host tier are both CPU memory and run the same bookkeeping and batched
copies as on a GPU. Not dummy weights: theirs (uniform within 1e-3) leave
attention's share of the output below float noise, so a block copied wrong
would not change a token.

The oracle is the same engine without a host tier (itself checked against HF
transformers in test_models.py / test_hf_parity.py): KV copied out and back must
give the same greedy tokens as KV kept or recomputed, and those tokens depend
on the prompt (a wrong block would change them).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine import LLM, SamplingParams
from engine.device import GiB
from tests.conftest import hf_greedy_ids

BS = 8
# One KV block of the tiny Llama in fp32: K and V x 2 layers x 8 tokens x 2 heads x 16.
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def slots(n: int) -> float:
    """swap_space (GiB) holding exactly ``n`` blocks."""
    return n * BLOCK_BYTES / GiB


@pytest.fixture(scope="module")
def llama_dir(tiny_llama_dir):
    return tiny_llama_dir


def make_llm(model_dir, num_blocks: int, device: str = "cpu", **kwargs) -> LLM:
    return LLM(
        str(model_dir),
        device=device,
        dtype="float32",
        skip_tokenizer_init=True,
        kvcache_block_size=BS,
        num_kvcache_blocks=num_blocks,
        max_model_len=16 * BS,
        **kwargs,
    )


def assert_idle(llm: LLM) -> None:
    """Every block of both tiers free again (possibly still cached); books balance."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.has_work()
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    if engine.host_tier is not None:
        engine.host_tier.check_invariants()
        assert engine.host_tier.num_free_slots == engine.host_tier.num_slots


def conversations(n: int) -> list[list[int]]:
    """First turns: distinct 37-token prompts (4 full blocks and a bit)."""
    return [[(c * 131 + i * 17 + 5) % 500 for i in range(37)] for c in range(n)]


def run_two_turns(llm: LLM, order=range(8)) -> tuple[list[list[int]], list[int]]:
    """Eight conversations, one request at a time: every first turn, then every
    second turn (the first turn's prompt and answer and 12 new tokens), in
    ``order``. The working set is about four times the device pool, so a
    conversation's prefix has left the device pool by its second turn.
    Returns the answers and each second turn's cached tokens, by conversation."""
    firsts = conversations(8)
    answers, seconds = [], []
    for prompt in firsts:
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        answers.append(out.outputs[0].token_ids)
        seconds.append(prompt + list(out.outputs[0].token_ids) + [7 + len(seconds)] * 12)
    cached = [0] * len(seconds)
    answers += [[]] * len(seconds)
    for c in order:
        (out,) = llm.generate([seconds[c]], GREEDY, use_tqdm=False)
        answers[len(firsts) + c] = out.outputs[0].token_ids
        cached[c] = out.num_cached_tokens
    return answers, cached


@pytest.fixture(scope="module")
def without_tier(llama_dir):
    llm = make_llm(llama_dir, num_blocks=16)
    answers, cached = run_two_turns(llm)
    assert len({tuple(a) for a in answers}) > len(answers) // 2  # they follow the prompts
    return answers, cached, llm.llm_engine.stats()


def test_second_turns_load_their_evicted_prefix_from_the_host_tier(llama_dir, without_tier):
    answers, cached_before, before = without_tier
    assert not any(cached_before)  # the device pool alone kept no prefix
    llm = make_llm(llama_dir, num_blocks=16, swap_space=slots(64))
    got, cached = run_two_turns(llm)
    stats = llm.llm_engine.stats()
    assert got == answers
    # Each second turn reuses its first turn's 4 full prompt blocks at least.
    assert all(c >= 4 * BS for c in cached), cached
    assert stats.host_tier_hit_blocks >= 8 * 4
    assert stats.num_computed_tokens <= before.num_computed_tokens - 8 * 4 * BS
    assert stats.num_blocks_copied_to_device == stats.host_tier_hit_blocks
    assert stats.bytes_copied_to_device == stats.host_tier_hit_blocks * BLOCK_BYTES
    # Every copy in was timed (a CPU: its wall time), and took some.
    assert 0 < stats.seconds_copying_to_device < 60
    assert stats.num_blocks_copied_to_host > 0 and stats.num_host_kv_blocks == 64
    assert_idle(llm)


def test_a_full_host_tier_keeps_the_most_recent_prefixes(llama_dir, without_tier):
    """A tier of 12 blocks holds only the last two conversations' 5 full blocks
    each (LRU): second turns taken newest first hit for those and miss for the
    oldest, and the answers stay the same."""
    answers, _, _ = without_tier
    llm = make_llm(llama_dir, num_blocks=16, swap_space=slots(12))
    got, cached = run_two_turns(llm, order=range(7, -1, -1))
    assert got == answers
    assert cached[7] >= 4 * BS and cached[6] >= 4 * BS
    assert cached[0] == 0
    assert_idle(llm)


def pressure_prompts() -> list[list[int]]:
    return [[(p * 71 + i * 29 + 3) % 500 for i in range(30 + 5 * p)] for p in range(4)]


@pytest.fixture(scope="module")
def unpressured(llama_dir):
    llm = make_llm(llama_dir, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(pressure_prompts(), params, use_tqdm=False)
    assert llm.llm_engine.stats().num_preemptions == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("tier_blocks", "async_scheduling"), [(64, True), (3, False)])
def test_swap_preemption_under_kv_pressure_keeps_outputs(
    llama_dir, unpressured, tier_blocks, async_scheduling
):
    """A 17-block pool admits the four prompts and cannot hold them as they grow:
    victims go to the host tier and back (under async scheduling too, where a
    victim's last token is still on the device), or, with a 3-block tier too
    small for any of them, fall back to recompute."""
    llm = make_llm(
        llama_dir,
        num_blocks=17,
        swap_space=slots(tier_blocks),
        preemption_mode="swap",
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(pressure_prompts(), params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == unpressured
    assert stats.num_preemptions > 0
    if tier_blocks == 64:
        assert stats.num_swap_preemptions == stats.num_preemptions
        assert stats.num_swap_fallbacks == 0
    else:
        assert stats.num_swap_preemptions == 0
        assert stats.num_swap_fallbacks == stats.num_preemptions
    assert_idle(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_swap_preemption_keeps_outputs(llama_dir, unpressured, method):
    """Speculating under the same pressure: victims swap out and back, their
    proposals dropped (made again once they run) and, with a draft model,
    their draft KV recomputed (the host tier holds the target's only). Greedy
    tokens equal the non-speculative unpressured run's; the model drafting
    for itself keeps every proposal, which a draft reading stale KV in its
    swapped-in blocks would not."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 2}
    else:
        spec["model"] = str(llama_dir)
    llm = make_llm(llama_dir, num_blocks=17, swap_space=slots(64), preemption_mode="swap",
                   speculative_config=spec)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(pressure_prompts(), params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == unpressured
    assert stats.num_swap_preemptions > 0 and stats.num_swap_fallbacks == 0
    assert stats.spec_decode.num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.spec_decode.acceptance_rate == 1.0
    assert_idle(llm)


# -- Tensor parallelism: every rank holds its heads of every slot ---------------
# One TP = 2 engine (one of the tiny Llama's two KV heads a rank) serves both
# tests: rank 0 keeps the bookkeeping, rank 1 issues the same copies from the
# step hand-off. A rank that skipped or misplaced a copy would feed its heads
# another block's KV, and the greedy tokens would part from TP = 1's.


@pytest.fixture(scope="module")
def tp2_tiered(llama_dir):
    # Each rank's block is half of BLOCK_BYTES: swap_space (per rank) for 64 slots.
    llm = make_llm(
        llama_dir,
        num_blocks=16,
        swap_space=slots(64) / 2,
        preemption_mode="swap",
        tensor_parallel_size=2,
    )
    yield llm
    llm.llm_engine.shutdown()


def test_tp2_second_turns_hit_the_host_tier_and_answer_as_tp1_without_it(
    tp2_tiered, without_tier, tiny_model
):
    answers, _, _ = without_tier
    got, cached = run_two_turns(tp2_tiered)
    stats = tp2_tiered.llm_engine.stats()
    assert got == answers
    hf = tiny_model("llama")[1]  # and HF transformers' tokens for the turns the tier served
    for c, first in enumerate(conversations(8)):
        second = first + list(got[c]) + [7 + c] * 12
        assert list(got[8 + c]) == hf_greedy_ids(hf, second, GREEDY.max_tokens)
    assert all(c >= 4 * BS for c in cached), cached
    assert stats.num_host_kv_blocks == 64 and stats.host_tier_hit_blocks >= 8 * 4
    # Both ranks' halves of each block: one TP = 1 block's bytes.
    assert stats.bytes_copied_to_device == stats.host_tier_hit_blocks * BLOCK_BYTES
    assert_idle(tp2_tiered)


def test_tp2_swap_preemption_under_kv_pressure_keeps_outputs(tp2_tiered, unpressured):
    """The 16-block pool cannot hold the four prompts as they grow: every victim
    goes to both ranks' host tiers and back, and the tokens equal those of a
    TP = 1 pool large enough to never preempt (which recompute matches too)."""
    engine = tp2_tiered.llm_engine
    before = engine.stats().num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = tp2_tiered.generate(pressure_prompts(), params, use_tqdm=False)
    stats = engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == unpressured
    assert stats.num_preemptions > before
    assert stats.num_swap_preemptions == stats.num_preemptions and not stats.num_swap_fallbacks
    # A reservation waits for its copies on every rank (a KV transfer writes next).
    reservation = engine.reserve_request("r", pressure_prompts()[0] + [9] * BS, GREEDY)
    assert reservation is not None and reservation.first_block > 0
    assert not engine.tier_transfers.busy
    engine.abort_request("r")
    engine.step()
    assert_idle(tp2_tiered)


def test_a_reservation_spills_what_it_evicts_before_its_kv_lands(llama_dir):
    """Decode node: a reservation that evicts cached blocks finds their copies
    done when it returns (a KV transfer then writes the blocks)."""
    llm = make_llm(llama_dir, num_blocks=16, swap_space=slots(16))
    engine = llm.llm_engine
    (first,) = conversations(1)
    llm.generate([first], GREEDY, use_tqdm=False)  # 5 cached blocks
    other = [(i * 7 + 1) % 500 for i in range(15 * BS)]
    reservation = engine.reserve_request("r", other, GREEDY)
    assert reservation is not None and not engine.tier_transfers.busy
    stats = engine.stats()
    assert stats.num_blocks_copied_to_host == 4  # its 15 blocks took 4 of the 5 cached
    assert engine.host_tier.num_cached_slots == 4
    engine.abort_request("r")
    engine.step()
    assert_idle(llm)


def test_swap_needs_a_host_tier(llama_dir):
    with pytest.raises(ValueError, match="swap_space"):
        make_llm(llama_dir, num_blocks=16, preemption_mode="swap")
    with pytest.raises(ValueError, match="swap_space"):
        make_llm(llama_dir, num_blocks=16, swap_space=-1)


def test_a_node_publishes_both_tiers_and_routing_reads_them_in_one_view(llama_dir):
    """The heartbeat publishes the engine's own events (a real redis-server):
    a first turn evicted from the pool is a host-tier hit for routing, and
    once its second turn loaded it back, a device hit again."""
    import asyncio

    from common.cluster.state import Cluster, NodeInfo, NodeRole
    from common.runtime.heartbeat import Heartbeat
    from engine.block_hash import hash_prompt_blocks
    from engine.engine_thread import EngineThread
    from pdserve.redis_server import RedisServer

    llm = make_llm(llama_dir, num_blocks=16, swap_space=slots(64))
    engine = llm.llm_engine
    engine.enable_cache_events()
    firsts = conversations(8)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in firsts]  # one at a time
    name = engine.config.served_model_name
    info = NodeInfo("p0", NodeRole.PREFILL, "127.0.0.1:1", name, BS)

    async def publish(cluster: Cluster) -> tuple[dict, dict]:
        """One beat from a fresh engine thread (llm.generate drives the engine
        itself in between); each conversation's (device, host) hit."""
        thread = EngineThread(engine).start()
        try:
            await Heartbeat(cluster, thread, info).beat()
        finally:
            thread.stop()
        view = await cluster.view([])
        assert [c.node.node_id for c in view.candidates] == ["p0"]
        hits = {}
        for c, prompt in enumerate(firsts):
            (cand,) = (await cluster.view(hash_prompt_blocks(prompt, name, BS))).candidates
            hits[c] = (cand.hit_blocks, cand.host_hit_blocks)
        sets = {
            "device": await cluster.node_blocks("p0"),
            "host": await cluster.node_blocks("p0", host=True),
        }
        return hits, sets

    async def go(url: str) -> None:
        cluster = Cluster.from_url(url, prefix="tier")
        try:
            hits, sets = await publish(cluster)
            assert sets["host"] == set(engine.host_tier.cached_hashes()) != set()
            assert sets["device"] == set(engine.block_manager.cached_hashes())
            assert hits[0] == (0, 4)  # evicted from the pool: all 4 prompt blocks in the tier
            assert hits[7] == (4, 0)  # the last one is still in the pool
            (node,) = await cluster.nodes()
            # Free counts evictable cached slots too: at idle every slot.
            assert (node.host_kv_blocks_total, node.host_kv_blocks_free) == (64, 64)
            second = firsts[0] + list(outs[0].outputs[0].token_ids) + [7] * 12
            (out,) = llm.generate([second], GREEDY, use_tqdm=False)
            assert out.num_cached_tokens >= 4 * BS
            hits, _ = await publish(cluster)
            assert hits[0] == (4, 0)  # loaded back: a device hit again
        finally:
            await cluster.close()

    with RedisServer() as server:
        asyncio.run(go(server.url))
    assert_idle(llm)


def test_an_fp8_cache_moves_through_the_host_tier_unchanged(llama_dir):
    """FP8 KV (one byte an element) spilled and loaded back: the same greedy
    tokens as the FP8 engine keeping or recomputing its KV, a quarter of fp32's
    bytes per block copied."""
    want, _ = run_two_turns(make_llm(llama_dir, num_blocks=16, kv_cache_dtype="fp8"))
    llm = make_llm(llama_dir, num_blocks=16, swap_space=slots(64) / 4, kv_cache_dtype="fp8")
    got, cached = run_two_turns(llm)
    stats = llm.llm_engine.stats()
    assert got == want
    assert all(c >= 4 * BS for c in cached), cached
    assert stats.num_host_kv_blocks == 64 and stats.host_tier_hit_blocks >= 8 * 4
    assert stats.bytes_copied_to_device == stats.host_tier_hit_blocks * BLOCK_BYTES // 4
    assert_idle(llm)


# -- Disaggregation: both nodes' host tiers --------------------------------------
# The prefill node's real streamer into a loopback landing on the decode engine
# (tests/engine/test_disaggregation.py's ``disaggregated``); routing reads both
# nodes' published tiers from a real redis-server.


@dataclass(slots=True)
class SecondTurn:
    first_block: int  # the decode node held the blocks before it: never sent
    sent_bytes: int  # the KV the transfer carried (as the decode node counts it)
    cached_tokens: int  # usage: the prompt tokens the prefill node did not compute
    token_ids: list[int]


def disaggregated_turn(prefill: LLM, decode: LLM, request_id: str, prompt: list[int]):
    """One request prefilled on ``prefill`` and decoded on ``decode``: its
    figures, and the seconds' prompt that continues it."""
    from common.kv_transfer.loopback import LoopbackLanding
    from tests.engine.test_disaggregation import disaggregated

    landing = LoopbackLanding(decode.llm_engine.model_runner)
    res, out = disaggregated(prefill, decode, request_id, prompt, GREEDY, landing=landing)
    tokens = list(out.outputs[0].token_ids)
    return SecondTurn(res.first_block, landing.received_bytes, out.num_cached_tokens, tokens)


def disaggregated_turns(prefill: LLM, decode: LLM, before_seconds=None):
    """``run_two_turns`` (its conversations, in order), each turn prefilled on
    ``prefill`` and decoded on ``decode``; ``before_seconds(seconds)`` runs
    between the first and the second turns. Returns the answers, each second
    turn's figures, and the second turns' prompts."""
    answers, seconds = [], []
    for c, prompt in enumerate(conversations(8)):
        answers.append(disaggregated_turn(prefill, decode, f"first-{c}", prompt).token_ids)
        seconds.append(prompt + answers[-1] + [7 + c] * 12)
    if before_seconds is not None:
        before_seconds(seconds)
    turns = [disaggregated_turn(prefill, decode, f"second-{c}", p) for c, p in enumerate(seconds)]
    return answers, turns, seconds


def route_of(prefill: LLM, decode: LLM, prompt: list[int]):
    """Where a router sends ``prompt`` once both engines published their tiers
    (one heartbeat each); remote prefill whatever the decode node caches."""
    import asyncio

    from common.cluster.state import Cluster, NodeInfo, NodeRole
    from common.runtime.heartbeat import Heartbeat
    from engine.block_hash import hash_prompt_blocks
    from engine.engine_thread import EngineThread
    from pdserve.redis_server import RedisServer
    from router.policy import RouteRequest, RoutingConfig, choose_route

    name = decode.llm_engine.config.served_model_name

    async def go(url: str):
        cluster = Cluster.from_url(url, prefix="tiers")
        try:
            nodes = (("p0", NodeRole.PREFILL, prefill), ("d0", NodeRole.DECODE, decode))
            for node_id, role, llm in nodes:
                thread = EngineThread(llm.llm_engine).start()
                try:
                    info = NodeInfo(node_id, role, "127.0.0.1:1", name, BS)
                    await Heartbeat(cluster, thread, info).beat()
                finally:
                    thread.stop()
            view = await cluster.view(hash_prompt_blocks(prompt, name, BS))
        finally:
            await cluster.close()
        config = RoutingConfig(local_prefill_max_tokens=0, local_prefill_min_hit=1.0)
        return choose_route(view, RouteRequest(name, BS, len(prompt)), config)

    with RedisServer() as server:
        return asyncio.run(go(server.url))


def test_a_decode_nodes_host_tier_shrinks_the_next_turns_transfer(llama_dir, without_tier):
    """Disaggregated, the pools alone keep no conversation's prefix: every
    second turn's whole KV is sent. With host tiers on both nodes, the decode
    node's reservation counts the first turn's blocks in its tier (prompt and
    answer) as its own -- copied in there, never sent -- and the prefill node
    loads the first turn's prompt blocks from its tier (usage cached_tokens);
    routing saw those very hits; the text is the tierless engine's. With the
    decode node's tiers flushed, the prefill node's tier hit goes on the wire
    with the rest."""
    want, _, _ = without_tier
    plain_answers, plain, _ = disaggregated_turns(
        make_llm(llama_dir, num_blocks=16), make_llm(llama_dir, num_blocks=16)
    )
    assert not any(t.first_block or t.cached_tokens for t in plain)
    assert plain_answers + [t.token_ids for t in plain] == [list(a) for a in want]

    prefill, decode = (make_llm(llama_dir, num_blocks=16, swap_space=slots(64)) for _ in "pd")
    for llm in (prefill, decode):
        llm.llm_engine.enable_cache_events()
    routes = []
    answers, turns, seconds = disaggregated_turns(
        prefill, decode, lambda seconds: routes.append(route_of(prefill, decode, seconds[0]))
    )
    assert answers + [t.token_ids for t in turns] == [list(a) for a in want]
    block_bytes = decode.llm_engine.model_runner.kv_block_bytes
    for t, p in zip(turns, plain, strict=True):
        # 37 prompt and 8 answer tokens: 5 full blocks held, 4 of them prompt.
        assert t.first_block >= 5, turns
        assert t.sent_bytes == p.sent_bytes - t.first_block * block_bytes
        assert t.cached_tokens >= 4 * BS, turns
    stats = decode.llm_engine.stats()
    held = sum(t.first_block for t in turns) * BS
    assert stats.host_tier_hit_blocks * BS + stats.prefix_cache_hit_tokens == held
    assert stats.host_tier_hit_blocks >= 8 * 4
    assert stats.num_blocks_copied_to_device == stats.host_tier_hit_blocks
    assert prefill.llm_engine.stats().host_tier_hit_blocks >= 8 * 4
    # What the router (and `pdctl explain`, its score lines) saw of the first
    # conversation is what the nodes then served from their host tiers.
    (route,) = routes
    assert (route.decode.node_id, route.prefill.node_id) == ("d0", "p0")
    assert (route.decode_hit_blocks, route.decode_host_hit_blocks) == (0, turns[0].first_block)
    assert route.prefill_host_hit_blocks * BS == turns[0].cached_tokens
    scores = {s.node_id: (s.hit_blocks, s.host_hit_blocks) for s in route.scores}
    assert scores == {"d0": (0, turns[0].first_block), "p0": (0, turns[0].cached_tokens // BS)}
    # The decode node's tiers flushed: the same prompt again is sent whole,
    # the prefill node's hit (its tier's blocks copied in) with the rest.
    decode.llm_engine.reset_prefix_cache()
    hits = prefill.llm_engine.stats().host_tier_hit_blocks
    again = disaggregated_turn(prefill, decode, "again-0", seconds[0])
    assert again.first_block == 0 and again.sent_bytes == plain[0].sent_bytes
    assert prefill.llm_engine.stats().host_tier_hit_blocks > hits
    assert again.cached_tokens >= 4 * BS and again.token_ids == turns[0].token_ids
    assert_idle(prefill)
    assert_idle(decode)
