"""The NetworkPolicies, evaluated: who can reach which port of which pod.

A small evaluator of the NetworkPolicy semantics the manifests use (pod
selectors by labels in the namespace, named and numbered ports, rules without
`from` for "anyone") runs over the rendered overlays, with the pods' real
labels and container ports. So a relabelled pod or a renamed port that would
cut a path (or open one) fails here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest

from tests.deploy.k8s import COMPONENTS, OVERLAYS, container, find, ports, render

# An ephemeral port: where NCCL (GPU) and gloo (CPU) connect after the rendezvous.
EPHEMERAL = 40123


@dataclass
class Pod:
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    same_namespace: bool = True


def pods(docs) -> dict[str, Pod]:
    out = {}
    for dep in find(docs, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        out[labels["app.kubernetes.io/component"]] = Pod(labels, ports(container(dep)))
    # Callers that are not pdserve's own pods.
    out["other"] = Pod({"app": "something-else"})
    out["admin-client"] = Pod({"pdserve.io/admin-client": "true"})
    out["elsewhere"] = Pod({"app": "client"}, same_namespace=False)
    return out


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"evaluator knows matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, src: Pod) -> bool:
    assert set(peer) == {"podSelector"}, f"evaluator knows podSelector peers only: {peer}"
    return src.same_namespace and _selects(peer["podSelector"], src.labels)


def _port_matches(rule_port: dict, dst: Pod, port: int) -> bool:
    assert "endPort" not in rule_port and rule_port.get("protocol", "TCP") == "TCP"
    p = rule_port["port"]
    return (dst.ports.get(p) if isinstance(p, str) else p) == port


def allowed(docs, src: Pod, dst: Pod, port: int) -> bool:
    policies = [
        np
        for np in find(docs, "NetworkPolicy")
        if "Ingress" in np["spec"].get("policyTypes", ["Ingress"])
        and _selects(np["spec"]["podSelector"], dst.labels)
    ]
    if not policies:
        return True  # not isolated
    for np in policies:
        for rule in np["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers and not any(_peer_matches(peer, src) for peer in peers):
                continue
            rule_ports = rule.get("ports")
            if rule_ports and not any(_port_matches(rp, dst, port) for rp in rule_ports):
                continue
            return True
    return False


# (caller, callee, port name or number): what pdserve needs, and nothing more.
MUST_REACH = [
    ("elsewhere", "router", "grpc"),
    ("elsewhere", "router", "http"),  # the OpenAI-compatible HTTP API
    ("admin-client", "router", "admin"),
    ("router", "redis", "redis"),
    ("prefill", "redis", "redis"),
    ("decode", "redis", "redis"),
    ("router", "decode", "grpc"),  # Decode streams; admin FlushCache
    ("router", "prefill", "grpc"),  # admin FlushCache
    ("decode", "prefill", "grpc"),  # Prefill calls
    ("prefill", "decode", "kv-store"),  # TCPStore rendezvous
    ("prefill", "decode", EPHEMERAL),  # NCCL / gloo
    ("decode", "prefill", EPHEMERAL),
    *[("elsewhere", c, "metrics") for c in COMPONENTS],
]
MUST_NOT_REACH = [
    ("elsewhere", "redis", "redis"),
    ("other", "redis", "redis"),
    ("admin-client", "redis", "redis"),
    ("elsewhere", "router", "admin"),
    ("other", "router", "admin"),
    ("prefill", "router", "admin"),
    ("other", "prefill", "grpc"),
    ("elsewhere", "prefill", "grpc"),
    ("other", "decode", "grpc"),
    ("elsewhere", "decode", "grpc"),
    ("other", "decode", "kv-store"),
    ("router", "decode", "kv-store"),
    ("other", "decode", EPHEMERAL),
    ("router", "prefill", EPHEMERAL),
    ("prefill", "prefill", "grpc"),
    ("decode", "decode", "kv-store"),
]


def check(docs, src: str, dst: str, port) -> bool:
    everyone = pods(docs)
    target = everyone[dst]
    number = target.ports[port] if isinstance(port, str) else port
    return allowed(docs, everyone[src], target, number)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"overlay-{o}" for o in OVERLAYS])
def test_every_path_pdserve_needs_is_open(overlay):
    docs = render(f"overlays/{overlay}")
    closed = [case for case in MUST_REACH if not check(docs, *case)]
    assert not closed, f"{overlay}: blocked: {closed}"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"overlay-{o}" for o in OVERLAYS])
def test_nothing_else_is_open(overlay):
    docs = render(f"overlays/{overlay}")
    opened = [case for case in MUST_NOT_REACH if check(docs, *case)]
    assert not opened, f"{overlay}: open: {opened}"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"overlay-{o}" for o in OVERLAYS])
def test_every_container_port_has_a_stated_caller(overlay):
    # A new port must be added to MUST_REACH (and its policy) on purpose.
    docs = render(f"overlays/{overlay}")
    stated = {(dst, port) for _, dst, port in MUST_REACH}
    for name, pod in pods(docs).items():
        for port in pod.ports:
            assert (name, port) in stated, f"{overlay}: who calls {name}'s {port} port?"


def test_a_relabelled_pod_loses_its_paths():
    # The evaluator is not vacuous: decode pods that lose the label the
    # policies select on can no longer be reached by prefill nodes' KV pushes...
    docs = copy.deepcopy(list(render("overlays/cpu-demo")))
    (decode,) = find(docs, "Deployment", name="pdserve-decode")
    decode["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] = "decoder"
    everyone = pods(docs)
    assert not allowed(docs, everyone["prefill"], everyone["decoder"], 29600)
    # ...and a Redis policy that forgets a caller shuts it out.
    docs = copy.deepcopy(list(render("overlays/cpu-demo")))
    (redis,) = find(docs, "NetworkPolicy", name="pdserve-redis")
    redis["spec"]["ingress"][0]["from"].pop()  # the decode nodes
    assert not check(docs, "decode", "redis", "redis")
