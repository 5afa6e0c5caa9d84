"""The model a request names (base or LoRA adapter) and adapter-aware routing:
pure functions over synthetic registrations (no Redis, no nodes)."""

from __future__ import annotations

import random

import pytest

from common.cluster.state import (
    ClusterView,
    NodeInfo,
    NodeRole,
    RouteCandidate,
    lora_adapters_json,
    lora_adapters_of,
    lora_resident_json,
    lora_resident_of,
)
from engine.block_hash import BlockHasher, lora_extra_key
from router.models import (
    BASE_MODEL,
    ModelChoice,
    ModelNotFound,
    holds_adapter,
    resolve_model,
    served_adapters,
)
from router.policy import NoRoute, RouteRequest, RoutingConfig, choose_route

BS = 16
NOW_MS = 1_000_000


def node(node_id, role=NodeRole.DECODE, adapters=None, model_id="m", free=1000, resident=()):
    return NodeInfo(
        node_id=node_id,
        role=role,
        address=f"{node_id}:1",
        model_id=model_id,
        block_size=BS,
        kv_blocks_total=1000,
        kv_blocks_free=free,
        max_num_seqs=64,
        seen_ms=NOW_MS - 100,
        lora_adapters=lora_adapters_json(adapters or {}),
        lora_resident=lora_resident_json(list(resident)),
    )


def route(nodes, model, prompt_tokens=2048, hits=None):
    hits = hits or {}
    view = ClusterView(NOW_MS, [RouteCandidate(n, hits.get(n.node_id, 0), False) for n in nodes])
    request = RouteRequest("m", BS, prompt_tokens, model=model)
    return choose_route(view, request, RoutingConfig(), None, random.Random(0))


def test_registration_field_round_trips_through_the_route_value():
    n = node("d0", adapters={"sql": "aa", "chat": "bb"})
    assert lora_adapters_of(n) == {"sql": "aa", "chat": "bb"}
    back = NodeInfo.from_route("d0", [n.route_value(), "5"])
    assert lora_adapters_of(back) == {"sql": "aa", "chat": "bb"}
    assert lora_adapters_of(node("d1")) == {}
    n.lora_adapters = "not json"  # a malformed field reads as no adapters, never a crash
    assert lora_adapters_of(n) == {}


def test_resolve_base_adapter_and_unknown():
    adapters = {"sql": "aa"}
    assert resolve_model("", "m", adapters) is BASE_MODEL
    assert resolve_model("m", "m", adapters) is BASE_MODEL
    assert resolve_model("sql", "m", adapters) == ModelChoice("sql", "aa")
    with pytest.raises(ModelNotFound, match=r"'nope' does not exist.*'m', 'sql'"):
        resolve_model("nope", "m", adapters)


def test_served_adapters_majority_digest_and_other_models_ignored():
    nodes = [
        node("d0", adapters={"sql": "aa"}),
        node("d1", adapters={"sql": "aa", "chat": "cc"}),
        node("p0", NodeRole.PREFILL, adapters={"sql": "bb"}),
        node("x0", adapters={"other": "dd"}, model_id="another-model"),
    ]
    assert served_adapters(nodes, "m") == {"chat": "cc", "sql": "aa"}
    # the stale digest's node is not fit for the adapter
    assert holds_adapter(nodes[0], ModelChoice("sql", "aa"))
    assert not holds_adapter(nodes[2], ModelChoice("sql", "aa"))
    assert holds_adapter(nodes[2], BASE_MODEL)


def test_adapter_requests_go_only_to_nodes_holding_it_on_both_sides():
    nodes = [
        node("d0"),  # base only, and emptier: the base request's choice
        node("d1", adapters={"sql": "aa"}, free=100),
        node("p0", NodeRole.PREFILL),
        node("p1", NodeRole.PREFILL, adapters={"sql": "aa"}),
    ]
    d = route(nodes, ModelChoice("sql", "aa"))
    assert (d.decode.node_id, d.prefill.node_id) == ("d1", "p1")
    excluded = {s.node_id: s.excluded for s in d.scores if s.excluded}
    assert excluded == {"d0": "lacks LoRA adapter 'sql'", "p0": "lacks LoRA adapter 'sql'"}
    base = route(nodes, BASE_MODEL)
    assert base.decode.node_id == "d0"


def test_adapter_without_a_prefill_node_prefills_locally_and_none_refuses():
    nodes = [node("d1", adapters={"sql": "aa"}), node("p0", NodeRole.PREFILL)]
    d = route(nodes, ModelChoice("sql", "aa"))
    assert d.decode.node_id == "d1" and d.prefill is None
    assert d.local_prefill_reason == "no prefill node is usable"
    with pytest.raises(NoRoute, match="lacks LoRA adapter 'sql'"):
        route([node("d0"), node("d2", adapters={"sql": "zz"})], ModelChoice("sql", "aa"))


def test_a_node_with_the_adapter_in_a_device_slot_costs_no_adapter_load():
    """Equal nodes but one with the adapter resident: that one wins on both
    sides, and the other's score carries the load term (tokens on a prefill
    node; on a decode node the same tokens as a fraction of the prompt)."""
    sql = {"sql": "aa"}
    nodes = [
        node("d0", adapters=sql),
        node("d1", adapters=sql, resident=["sql"]),
        node("p0", NodeRole.PREFILL, adapters=sql, resident=["other", "sql"]),
        node("p1", NodeRole.PREFILL, adapters=sql),
    ]
    config = RoutingConfig()
    for seed in range(4):  # never the tie-break's luck
        view = ClusterView(NOW_MS, [RouteCandidate(n, 0, False) for n in nodes])
        request = RouteRequest("m", BS, 2048, model=ModelChoice("sql", "aa"))
        d = choose_route(view, request, config, None, random.Random(seed))
        assert (d.decode.node_id, d.prefill.node_id) == ("d1", "p0")
    terms = {s.node_id: s.terms for s in d.scores}
    assert terms["p1"]["lora_load"] == config.lora_load_tokens
    assert terms["d0"]["lora_load"] == pytest.approx(config.lora_load_tokens / 2048)
    assert "lora_load" not in terms["d1"] and "lora_load" not in terms["p0"]
    # A much shorter queue still beats a resident adapter: the load is one term.
    nodes[2].queued_prefill_tokens = 4 * int(config.lora_load_tokens)
    assert route(nodes, ModelChoice("sql", "aa")).prefill.node_id == "p1"
    # The base model loads nothing anywhere; a short prompt's load is capped at a miss.
    assert all("lora_load" not in s.terms for s in route(nodes, BASE_MODEL).scores)
    short = route(nodes[:1], ModelChoice("sql", "aa"), prompt_tokens=8)
    assert short.scores[0].terms["lora_load"] == config.hit_weight
    with pytest.raises(ValueError, match="lora_load_tokens must be >= 0"):
        RoutingConfig(lora_load_tokens=-1)


def test_resident_field_round_trips_and_a_malformed_one_reads_as_none():
    n = node("d0", adapters={"a": "1", "b": "2"}, resident=["b", "a"])
    back = NodeInfo.from_route("d0", [n.route_value(), "5"])
    assert lora_resident_of(back) == {"a", "b"} and back.lora_resident == '["a","b"]'
    n.lora_resident = "{not json"
    assert lora_resident_of(n) == frozenset() and lora_resident_of(node("d1")) == frozenset()


def test_adapter_hashes_differ_from_base_and_match_the_engine_spec():
    ids = list(range(3 * BS))
    choice = ModelChoice("sql", "aa" * 16)
    assert choice.extra_keys == (lora_extra_key("aa" * 16),)
    base = BlockHasher("m", BS).hash_blocks(ids)
    lora = BlockHasher("m", BS, extra_keys=choice.extra_keys).hash_blocks(ids)
    assert len(lora) == 3 and not set(base) & set(lora)
    assert BASE_MODEL.extra_keys == ()
