"""The routing policy on synthetic cluster states (pure: no Redis, no clock)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from common.cluster.state import ClusterView, NodeInfo, NodeRole, RouteCandidate
from router.inflight import InflightTracker
from router.policy import (
    LocalLoad,
    NoRoute,
    RouteRequest,
    RoutingConfig,
    RoutingPolicy,
    choose_route,
)

NOW_MS = 1_000_000
BS = 16


def node(node_id: str, role: NodeRole = NodeRole.DECODE, **kw) -> NodeInfo:
    total = kw.pop("total", 1000)
    return NodeInfo(
        node_id=node_id,
        role=role,
        address=f"{node_id}:1",
        model_id=kw.pop("model_id", "m"),
        block_size=kw.pop("block_size", BS),
        kv_blocks_total=total,
        kv_blocks_free=kw.pop("free", total),
        max_num_seqs=kw.pop("max_num_seqs", 64),
        seen_ms=kw.pop("seen_ms", NOW_MS - 100),
        **kw,
    )


def cand(n: NodeInfo, hit: int = 0, drained: bool = False, host: int = 0) -> RouteCandidate:
    return RouteCandidate(n, hit, drained, host)


def view(*candidates: RouteCandidate, now_ms: int = NOW_MS) -> ClusterView:
    return ClusterView(now_ms, list(candidates))


def req(prompt_tokens: int = 2048, **kw) -> RouteRequest:
    return RouteRequest(model_id="m", block_size=BS, prompt_tokens=prompt_tokens, **kw)


def route(v, r=None, config=None, local=None, seed=0, turn=0):
    return choose_route(v, r or req(), config or RoutingConfig(), local, random.Random(seed), turn)


PREFILLS = (cand(node("p0", NodeRole.PREFILL)), cand(node("p1", NodeRole.PREFILL)))


# -- prefix affinity ----------------------------------------------------------


def test_the_prefill_node_caching_the_longest_prefix_wins():
    v = view(
        cand(node("d0")),
        cand(node("p0", NodeRole.PREFILL), hit=40),
        cand(node("p1", NodeRole.PREFILL), hit=100),
        cand(node("p2", NodeRole.PREFILL), hit=0),
    )
    d = route(v)
    assert d.prefill.node_id == "p1" and d.prefill_hit_blocks == 100
    assert d.local_prefill_reason == ""
    costs = {s.node_id: s.cost for s in d.scores if s.role is NodeRole.PREFILL}
    # The cost is the uncached prompt tokens there (nothing queued anywhere).
    assert costs == {"p0": 2048 - 40 * BS, "p1": 2048 - 100 * BS, "p2": 2048}


def test_a_long_queue_outweighs_a_small_prefix_hit():
    v = view(
        cand(node("d0")),
        cand(node("p0", NodeRole.PREFILL, queued_prefill_tokens=4000), hit=20),
        cand(node("p1", NodeRole.PREFILL), hit=0),
    )
    assert route(v).prefill.node_id == "p1"
    # ...but not a short one: 20 cached blocks save 320 tokens of work.
    v.candidates[1].node.queued_prefill_tokens = 300
    assert route(v).prefill.node_id == "p0"


def test_the_decode_node_caching_the_prompt_wins_and_prefills_it_locally():
    v = view(cand(node("d0")), cand(node("d1"), hit=110), *PREFILLS)
    d = route(v)
    assert d.decode.node_id == "d1" and d.decode_hit_blocks == 110
    assert d.prefill is None  # 1760 of 2048 tokens (86%) are cached there: no KV moves
    assert "caches 1760 of 2048" in d.local_prefill_reason
    d1 = next(s for s in d.scores if s.node_id == "d1")
    assert d1.terms["hit"] == pytest.approx(-1760 / 2048)
    # The unused prefill nodes are still scored, for the explanation.
    assert {s.node_id: s.cost for s in d.scores if s.role is NodeRole.PREFILL} == {
        "p0": 2048.0,
        "p1": 2048.0,
    }


# -- host tier ----------------------------------------------------------------


def test_a_host_tier_hit_is_priced_between_a_device_hit_and_recompute():
    # Same prefix (80 blocks) on each prefill node, in a different tier.
    v = view(
        cand(node("d0")),
        cand(node("p-device", NodeRole.PREFILL), hit=80),
        cand(node("p-host", NodeRole.PREFILL), host=80),
        cand(node("p-none", NodeRole.PREFILL)),
    )
    config = RoutingConfig(host_copy_cost=0.25)
    d = route(v, config=config)
    assert d.prefill.node_id == "p-device"
    scores = {s.node_id: s for s in d.scores}
    costs = {n: s.cost for n, s in scores.items() if s.role is NodeRole.PREFILL}
    assert costs["p-device"] < costs["p-host"] < costs["p-none"]
    assert scores["p-host"].terms == {
        "uncached": 2048 - 80 * BS,
        "queue": 0,
        "host_copy": pytest.approx(0.25 * 80 * BS),
    }
    assert (scores["p-host"].hit_blocks, scores["p-host"].host_hit_blocks) == (0, 80)
    # Without the device copy, the host-tier hit wins over no hit at all.
    d = route(view(*(c for c in v.candidates if c.node.node_id != "p-device")), config=config)
    assert d.prefill.node_id == "p-host" and d.prefill_host_hit_blocks == 80


def test_a_host_tier_hit_continues_the_device_hit_on_the_same_node():
    v = view(
        cand(node("d0")),
        cand(node("p0", NodeRole.PREFILL), hit=20, host=60),
        cand(node("p1", NodeRole.PREFILL), hit=50),
    )
    d = route(v, config=RoutingConfig(host_copy_cost=0.25))
    assert d.prefill.node_id == "p0"
    costs = {s.node_id: s.cost for s in d.scores if s.role is NodeRole.PREFILL}
    assert costs == {"p0": 2048 - 80 * BS + 0.25 * 60 * BS, "p1": 2048 - 50 * BS}
    # At the price of recomputing, a host hit is worth nothing.
    d = route(v, config=RoutingConfig(host_copy_cost=1.0))
    assert d.prefill.node_id == "p1"


def test_a_decode_nodes_host_hit_counts_less_than_a_device_hit_and_can_keep_it_local():
    v = view(cand(node("d-host"), host=110), cand(node("d-none")), *PREFILLS)
    config = RoutingConfig(host_copy_cost=0.25)
    d = route(v, config=config)
    assert d.decode.node_id == "d-host" and d.decode_host_hit_blocks == 110
    hit = next(s for s in d.scores if s.node_id == "d-host").terms["hit"]
    assert hit == pytest.approx(-0.75 * 1760 / 2048)
    # Its own prefill copies the prompt in: no KV moves.
    assert d.prefill is None and "caches 1760 of 2048" in d.local_prefill_reason
    # A device hit of the same length beats it.
    v = view(cand(node("d-host"), host=110), cand(node("d-device"), hit=110), *PREFILLS)
    assert route(v, config=config).decode.node_id == "d-device"


# -- load ----------------------------------------------------------------------


def test_the_least_loaded_decode_node_wins():
    v = view(
        cand(node("d0", running=30, free=500)),
        cand(node("d1", running=5, free=900)),
        cand(node("d2", running=20, free=700)),
        *PREFILLS,
    )
    assert route(v).decode.node_id == "d1"


def test_a_decode_node_without_room_for_the_prompt_loses_despite_its_cache():
    v = view(cand(node("d0", free=60), hit=50), cand(node("d1", running=40, free=400)), *PREFILLS)
    d = route(v)
    assert d.decode.node_id == "d1"
    d0 = next(s for s in d.scores if s.node_id == "d0")
    assert d0.terms["full"] == RoutingConfig().full_penalty


def test_ties_are_broken_at_random():
    v = view(cand(node("d0")), cand(node("d1")), cand(node("d2")), *PREFILLS)
    chosen = Counter(route(v, seed=s).decode.node_id for s in range(300))
    assert set(chosen) == {"d0", "d1", "d2"} and min(chosen.values()) > 60


# -- conditional disaggregation -------------------------------------------------


@pytest.mark.parametrize(
    "prompt_tokens, decode_hit, remote",
    [
        (200, 0, False),  # short prompt: <= 256 uncached tokens
        (256, 0, False),
        (257, 0, True),
        (2000, 110, False),  # 1760 cached tokens leave 240 uncached
        (4000, 150, True),  # 2400 of 4000 cached (60%), 1600 uncached
        (4000, 200, False),  # 3200 of 4000 cached (80%)
    ],
)
def test_local_prefill_thresholds(prompt_tokens, decode_hit, remote):
    v = view(cand(node("d0"), hit=decode_hit), *PREFILLS)
    d = route(v, req(prompt_tokens))
    assert (d.prefill is not None) == remote
    assert bool(d.local_prefill_reason) == (not remote)


def test_thresholds_are_configurable():
    v = view(cand(node("d0"), hit=200), *PREFILLS)
    always_remote = RoutingConfig(local_prefill_max_tokens=0, local_prefill_min_hit=1.0)
    assert route(v, req(4000), always_remote).prefill is not None
    never_remote = RoutingConfig(local_prefill_max_tokens=10**9)
    assert route(v, req(4000), never_remote).prefill is None


def test_without_a_usable_prefill_node_the_decode_node_prefills():
    d = route(view(cand(node("d0")), cand(node("p0", NodeRole.PREFILL), drained=True)))
    assert d.prefill is None and d.local_prefill_reason == "no prefill node is usable"
    d = route(view(cand(node("d0")), *PREFILLS), req(allow_remote_prefill=False))
    assert d.prefill is None and "n > 1" in d.local_prefill_reason


# -- exclusions -----------------------------------------------------------------


def test_unusable_nodes_are_excluded_with_a_reason():
    v = view(
        cand(node("d0"), hit=120, drained=True),
        cand(node("d1", draining=True), hit=120),
        cand(node("d2", seen_ms=NOW_MS - 4000), hit=120),
        cand(node("d3", model_id="other"), hit=120),
        cand(node("d4", block_size=32), hit=120),
        cand(node("d5"), hit=120),
        cand(node("d6", running=50, free=10)),
        *PREFILLS,
    )
    d = route(v, local={"d5": LocalLoad(failed_ago_s=1.0)})
    assert d.decode.node_id == "d6"  # the only usable one, loaded as it is
    why = {s.node_id: s.excluded for s in d.scores}
    assert why["d0"] == "drained by an operator"
    assert why["d1"] == "shutting down"
    assert why["d2"] == "last heartbeat 4.0 s ago"
    assert why["d3"] == "serves model 'other'"
    assert why["d4"] == "block size 32"
    assert why["d5"] == "a call to it failed 1.0 s ago"
    assert why["d6"] == "" and all(s.cost is None for s in d.scores if s.excluded)
    # The cool-down ends.
    d = route(v, local={"d5": LocalLoad(failed_ago_s=6.0)})
    assert d.decode.node_id == "d5"


def test_no_route_says_why():
    with pytest.raises(NoRoute, match="no decode node is registered"):
        route(view(*PREFILLS))
    v = view(cand(node("d0"), drained=True), cand(node("d1", seen_ms=NOW_MS - 9000)), *PREFILLS)
    with pytest.raises(NoRoute) as info:
        route(v)
    assert str(info.value) == (
        "no decode node can take the request "
        "(d0: drained by an operator; d1: last heartbeat 9.0 s ago)"
    )


# -- the router's own in-flight counts -------------------------------------------


def test_local_counts_since_the_last_report_add_to_the_report():
    v = view(cand(node("d0", running=10)), cand(node("d1", running=10)), *PREFILLS)
    local = {"d0": LocalLoad(requests=12, requests_since_report=12, blocks=0)}
    assert route(v, local=local).decode.node_id == "d1"
    # Sent before the report: already in it, not counted twice.
    local = {"d0": LocalLoad(requests=1, requests_since_report=0)}
    v.candidates[1].node.running = 11
    assert route(v, local=local).decode.node_id == "d0"


def test_a_node_reporting_zero_load_never_gets_more_than_its_share():
    # d0 always reports an empty node; the others report the truth, each just
    # after the previous request. Nothing finishes, so a fair share is 1/4.
    clock = [0.0]
    tracker = InflightTracker(clock=lambda: clock[0])
    nodes = [node(f"d{i}", total=100_000, max_num_seqs=1024) for i in range(4)]
    placed = Counter()
    rng = random.Random(1)
    for i in range(400):
        clock[0] = i * 0.001
        now_ms = NOW_MS + i
        for n in nodes:
            n.seen_ms = now_ms
        for n in nodes[1:]:
            n.running = placed[n.node_id]
            n.kv_blocks_free = n.kv_blocks_total - 17 * placed[n.node_id]
        v = view(*(cand(n) for n in nodes), now_ms=now_ms)
        d = choose_route(v, req(256), RoutingConfig(), tracker.loads(v), rng, i)
        tracker.start(d.decode.node_id, None, 256, 17)
        placed[d.decode.node_id] += 1
    assert placed["d0"] <= 400 // 4 + 1
    assert max(placed.values()) - min(placed.values()) <= 2, placed


def test_two_routers_on_stale_reports_place_evenly():
    # Reports frozen at an idle cluster (heartbeats lag): each router evens out
    # what it sent itself, so together they are even too.
    clock = [0.0]
    routers = [InflightTracker(clock=lambda: clock[0]) for _ in range(2)]
    nodes = [node(f"d{i}", seen_ms=NOW_MS) for i in range(5)]
    placed = Counter()
    rng = random.Random(2)
    for i in range(500):
        clock[0] += 0.001
        tracker = routers[i % 2]
        v = view(*(cand(n) for n in nodes), now_ms=NOW_MS + int(clock[0] * 1000))
        d = choose_route(v, req(512), RoutingConfig(), tracker.loads(v), rng, i)
        tracker.start(d.decode.node_id, None, 512, 33)
        placed[d.decode.node_id] += 1
    assert max(placed.values()) - min(placed.values()) <= 2, placed


def test_inflight_tracker_splits_at_the_report_and_forgets_finished_work():
    clock = [10.0]
    t = InflightTracker(clock=lambda: clock[0])
    early = t.start("d0", "p0", prefill_tokens=1000, blocks=70)
    clock[0] = 11.0
    late = t.start("d0", "p0", prefill_tokens=500, blocks=40)
    clock[0] = 11.5
    # Both nodes reported 1 s ago (at 10.5): between the two requests.
    v = view(
        cand(node("d0", seen_ms=NOW_MS - 1000)),
        cand(node("p0", NodeRole.PREFILL, seen_ms=NOW_MS - 1000)),
    )
    loads = t.loads(v)
    assert (loads["d0"].requests, loads["d0"].requests_since_report) == (2, 1)
    assert (loads["d0"].blocks, loads["d0"].blocks_since_report) == (110, 40)
    assert (loads["p0"].prefill_tokens, loads["p0"].prefill_tokens_since_report) == (1500, 500)
    t.first_token(early)
    assert t.loads(v)["p0"].prefill_tokens == 500
    t.finish(early)
    t.finish(late)
    assert t.loads(v) == {} and t.in_flight == 0
    t.failed("d0")
    clock[0] = 12.0
    assert t.loads(v)["d0"].failed_ago_s == pytest.approx(0.5)
    t.succeeded("d0")
    assert t.loads(v) == {}


def test_local_prefill_counts_on_the_decode_nodes_prefill_queue():
    t = InflightTracker(clock=lambda: 5.0)
    t.start("d0", None, prefill_tokens=300, blocks=20)
    loads = t.loads(view(cand(node("d0", seen_ms=0))))
    assert loads["d0"].prefill_tokens == 300 and loads["d0"].requests == 1


# -- baselines and config --------------------------------------------------------


def test_round_robin_cycles_over_usable_nodes_and_ignores_caches():
    v = view(
        cand(node("d0"), hit=120),
        cand(node("d1"), drained=True),
        cand(node("d2")),
        cand(node("p0", NodeRole.PREFILL), hit=120),
        cand(node("p1", NodeRole.PREFILL)),
    )
    rr = RoutingConfig(policy=RoutingPolicy.ROUND_ROBIN)
    picks = [route(v, config=rr, turn=t) for t in range(4)]
    assert [d.decode.node_id for d in picks] == ["d0", "d2", "d0", "d2"]
    assert [d.prefill.node_id for d in picks] == ["p0", "p1", "p0", "p1"]


def test_random_uses_every_usable_node():
    v = view(cand(node("d0")), cand(node("d1")), cand(node("d2"), drained=True), *PREFILLS)
    rnd = RoutingConfig(policy="random")
    seen = {
        (d.decode.node_id, d.prefill.node_id)
        for d in (route(v, config=rnd, seed=s) for s in range(50))
    }
    assert seen == {("d0", "p0"), ("d0", "p1"), ("d1", "p0"), ("d1", "p1")}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="fastest"), "routing policy must be one of cost, round-robin, random"),
        (dict(load_weight=-1.0), "load_weight must be >= 0"),
        (dict(hit_weight=float("nan")), "hit_weight must be >= 0"),
        (dict(local_prefill_max_tokens=-1), "local_prefill_max_tokens must be >= 0"),
        (dict(local_prefill_min_hit=1.5), r"local_prefill_min_hit must be in \[0, 1\]"),
        (dict(host_copy_cost=1.5), r"host_copy_cost must be in \[0, 1\]"),
        (dict(stale_heartbeat_s=0.0), "stale_heartbeat_s must be > 0"),
    ],
)
def test_config_errors_name_the_knob(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**kwargs)


def test_the_in_flight_prefill_estimate_leaves_out_host_tier_hits():
    from router.routing import Routed, Routing

    routing = Routing(cluster=None, model_id="m", block_size=BS)
    v = view(cand(node("d0")), cand(node("p0", NodeRole.PREFILL), hit=20, host=60))
    r = req()
    d = route(v, r)
    assert d.prefill.node_id == "p0"
    dispatch = routing.dispatch(Routed(d, v, r))
    assert dispatch.prefill_tokens == 2048 - 80 * BS  # copied in, not computed


# -- KV cache dtypes ----------------------------------------------------------


@pytest.mark.parametrize("policy", list(RoutingPolicy))
def test_an_fp8_prefill_node_never_feeds_a_model_dtype_decode_node(policy):
    """FP8 KV cannot feed a bf16 cache (engine/kv_cache_dtype.py): that prefill
    node is excluded, naming why; a bf16 prefill node may feed an FP8 decode node."""
    bf16, fp8 = "bfloat16", "fp8_e4m3"
    v = view(
        cand(node("d0", kv_cache_dtype=bf16)),
        cand(node("p0", NodeRole.PREFILL, kv_cache_dtype=fp8), hit=100),
        cand(node("p1", NodeRole.PREFILL, kv_cache_dtype=bf16)),
    )
    config = RoutingConfig(policy=policy)
    for turn in range(4):
        d = route(v, config=config, seed=turn, turn=turn)
        assert d.prefill.node_id == "p1"
        (line,) = [s for s in d.scores if s.node_id == "p0"]
        assert "FP8 KV cannot feed a bfloat16 cache" in line.excluded
    alone = view(cand(node("d0", kv_cache_dtype=bf16)), v.candidates[1])
    assert route(alone, config=config).prefill is None  # the decode node prefills itself
    to_fp8 = view(
        cand(node("d1", kv_cache_dtype=fp8)),
        cand(node("p1", NodeRole.PREFILL, kv_cache_dtype=bf16)),
    )
    assert route(to_fp8, config=config).prefill.node_id == "p1"


def test_a_prefill_node_feeds_only_a_decode_node_of_the_same_weights():
    """The decode node keys received blocks by its own numerics: bf16-weight
    KV on an FP8-weight decode node would pass for FP8-weight blocks, so such
    a prefill node is excluded, naming why; one that says nothing is kept."""
    fp8_decode = cand(node("d0", weight_dtype="fp8", kv_cache_dtype="fp8_e4m3"))
    v = view(
        fp8_decode,
        cand(node("p0", NodeRole.PREFILL, weight_dtype="bfloat16"), hit=100),
        cand(node("p1", NodeRole.PREFILL, weight_dtype="fp8", kv_cache_dtype="bfloat16")),
    )
    d = route(v)
    assert d.prefill.node_id == "p1"  # and bf16 KV into the FP8 cache is quantized on the way
    (line,) = [s for s in d.scores if s.node_id == "p0"]
    assert line.excluded.startswith("its weights are bfloat16 and the decode node's fp8")
    silent = view(fp8_decode, cand(node("p2", NodeRole.PREFILL), hit=100))
    assert route(silent).prefill.node_id == "p2"  # a node that does not say is not refused
