"""The manifests against the code: each container is parsed by the component's
own argument parser, with the environment the kubelet would give it, and what
comes out must match the manifests (ports, probes, Redis, model, drain).

So a renamed flag or variable, a moved default port, a health service renamed
in a .proto, or a grace period shorter than the drain fails here.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import dataclass
from urllib.parse import urlparse

import pytest

from common.grpc_server import OVERALL
from common.runtime.config import engine_kwargs
from common.runtime.node import CONTROL_SERVICE, SHUTDOWN_LIMIT_S
from engine.config import EngineConfig
from tests.conftest import TINY_CONFIGS, write_config_dir
from tests.deploy.k8s import (
    COMPONENTS,
    FIELD_VALUES,
    OVERLAYS,
    REPO,
    container,
    container_env,
    deployment,
    find,
    one,
    parse_component,
    pdctl_reads,
    ports,
    render,
    secret_placeholder,
)

# Where the image puts the demo model (deploy/Dockerfile, DEMO_MODEL=1).
DEMO_MODEL_PREFIX = "/opt/pdserve/models/"
# Seconds the router needs after its drain: closing the admin server (1 s) and
# channels. Nodes need at most common.runtime.node.SHUTDOWN_LIMIT_S (their watchdog).
ROUTER_SHUTDOWN_S = 10
# A grace period may exceed what a component needs by this much, no more:
# "matches the drain timeout", not "some large number".
GRACE_SLACK_S = 5


def health_services() -> dict[str, set[str]]:
    """grpc.health.v1 names each component's gRPC port answers for (the code's)."""
    from decode_node.main import SERVICE as DECODE
    from prefill_node.main import SERVICE as PREFILL
    from router.main import ROUTER

    return {
        "router": {OVERALL, ROUTER},
        "prefill": {OVERALL, PREFILL, CONTROL_SERVICE},
        "decode": {OVERALL, DECODE, CONTROL_SERVICE},
    }


CASES = [(o, c) for o in OVERLAYS for c in COMPONENTS]


@dataclass
class Parsed:
    """One component of one overlay, as the kubelet and then `pdserve` see it."""

    docs: tuple[dict, ...]
    dep: dict  # its Deployment
    c: dict  # its container
    env: dict[str, str]  # the container's environment
    sources: dict[str, dict]  # where each variable comes from
    ns: argparse.Namespace  # what the component's parser made of it
    read: set[str]  # the variables the parser looked up


def setup(overlay: str, component: str) -> Parsed:
    docs = render(f"overlays/{overlay}")
    dep = deployment(docs, component)
    c = container(dep)
    env, sources = container_env(docs, c)
    ns, read = parse_component(component, c["args"][1:], env)
    return Parsed(docs, dep, c, env, sources, ns, read)


def selected(deployments: list[dict], selector: dict) -> list[dict]:
    return [
        d
        for d in deployments
        if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]


@pytest.mark.parametrize("overlay,component", CASES)
def test_command_is_the_component(overlay, component):
    docs = render(f"overlays/{overlay}")
    c = container(deployment(docs, component))
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert c["command"] == ["pdserve"] and scripts["pdserve"] == "pdserve.cli:main"
    assert c["args"][0] == component
    from pdserve.cli import build_parser

    # `pdserve <component>` exists and runs the component's serve().
    parsed = build_parser().parse_args(c["args"])
    from tests.deploy.k8s import component_module

    assert parsed.serve is component_module(component).serve


@pytest.mark.parametrize("overlay,component", CASES)
def test_every_pdserve_variable_is_read_by_the_code(overlay, component):
    p = setup(overlay, component)
    env, sources, read = p.env, p.sources, p.read
    if component == "router":
        read = read | pdctl_reads(env)  # pdctl runs in the router's container
    unread = sorted(n for n in env if n.startswith(("PDSERVE_", "PDCTL_")) and n not in read)
    assert not unread, (
        f"{overlay}: pdserve {component} does not read {unread} (from "
        f"{[sources[n] for n in unread]}): a renamed or misplaced variable"
    )


@pytest.mark.parametrize("overlay,component", CASES)
def test_ports_are_the_ones_the_code_listens_on(overlay, component):
    p = setup(overlay, component)
    c, ns = p.c, p.ns
    declared = ports(c)
    expected = {"grpc": ns.port}
    if component == "router":
        expected["admin"] = ns.admin_port
    if component == "decode":
        expected["kv-store"] = ns.transfer_port
    for name, port in expected.items():
        assert declared.get(name) == port, f"{component}: port {name} is {port} in the code"
    assert "metrics" in declared, f"{component}: no metrics port"
    assert hasattr(ns, "metrics_port"), (
        f"pdserve {component} has no --metrics-port / PDSERVE_METRICS_PORT "
        "(it comes with the metrics work)"
    )
    assert declared["metrics"] == ns.metrics_port


@pytest.mark.parametrize("overlay,component", CASES)
def test_prometheus_annotations_point_at_the_metrics_port(overlay, component):
    docs = render(f"overlays/{overlay}")
    dep = deployment(docs, component)
    notes = dep["spec"]["template"]["metadata"].get("annotations", {})
    assert notes.get("prometheus.io/scrape") == "true"
    assert notes.get("prometheus.io/path") == "/metrics"
    assert int(notes["prometheus.io/port"]) == ports(container(dep))["metrics"]


@pytest.mark.parametrize("overlay,component", CASES)
def test_probes_ask_grpc_health_for_services_the_code_registers(overlay, component):
    p = setup(overlay, component)
    c, ns = p.c, p.ns
    names = health_services()[component]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind)
        assert probe is not None, f"{component}: no {kind}"
        assert "grpc" in probe, f"{component}: {kind} is not a native gRPC probe"
        assert probe["grpc"]["port"] == ns.port, f"{component}: {kind} on another port"
        service = probe["grpc"].get("service", OVERALL)
        assert service in names, f"{component}: {kind} asks for {service!r}; code has {names}"
    # Readiness names the component's own service, so it reads "this API is up".
    assert c["readinessProbe"]["grpc"]["service"] in names - {OVERALL, CONTROL_SERVICE}


@pytest.mark.parametrize("overlay,component", CASES)
def test_grace_period_covers_prestop_drain_and_shutdown(overlay, component):
    p = setup(overlay, component)
    dep, c, ns = p.dep, p.c, p.ns
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"{component}: preStop {command}"
    pre_stop = float(command[1])
    shutdown = ROUTER_SHUTDOWN_S if component == "router" else SHUTDOWN_LIMIT_S
    needed = pre_stop + ns.drain_timeout + shutdown
    assert needed <= grace <= needed + GRACE_SLACK_S, (
        f"{overlay} {component}: terminationGracePeriodSeconds {grace}, but preStop "
        f"{pre_stop:g} + drain {ns.drain_timeout:g} + shutdown {shutdown:g} = {needed:g}"
    )


@pytest.mark.parametrize("overlay,component", CASES)
def test_redis_url_and_password_reach_the_redis_in_the_manifests(overlay, component):
    p = setup(overlay, component)
    docs, env, ns = p.docs, p.env, p.ns
    url = urlparse(ns.redis_url)
    service = one(docs, "Service", name=url.hostname)
    (port,) = [sp for sp in service["spec"]["ports"] if sp["port"] == (url.port or 6379)]
    redis = deployment(docs, "redis")
    assert ports(container(redis))[port["targetPort"]] == 6379
    # The password Redis requires is the one pdserve sends.
    redis_env, _ = container_env(docs, container(redis))
    assert "$REDIS_PASSWORD" in container(redis)["args"][0]
    assert env.get("PDSERVE_REDIS_PASSWORD") == redis_env["REDIS_PASSWORD"]
    assert hasattr(ns, "redis_password"), (
        f"pdserve {component} has no --redis-password / PDSERVE_REDIS_PASSWORD "
        "(it comes with the security work)"
    )
    assert ns.redis_password == redis_env["REDIS_PASSWORD"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_admin_api_has_a_token_from_a_secret(overlay):
    # Without a token the admin API binds 127.0.0.1 only: unreachable in a pod.
    p = setup(overlay, "router")
    env, ns = p.env, p.ns
    assert ns.admin_token == secret_placeholder("pdserve-admin", "token")
    assert env["PDCTL_TOKEN"] == ns.admin_token


@pytest.mark.parametrize(
    "overlay,component", [(o, c) for o in OVERLAYS for c in ("prefill", "decode")]
)
def test_nodes_advertise_their_pod_ip_and_name(overlay, component):
    p = setup(overlay, component)
    sources, ns = p.sources, p.ns
    assert ns.advertise_host == FIELD_VALUES["status.podIP"]
    assert ns.node_id == FIELD_VALUES["metadata.name"]
    assert sources["PDSERVE_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


@pytest.mark.parametrize("overlay,component", CASES)
def test_model_is_in_a_volume_or_baked_into_a_demo_image(overlay, component):
    p = setup(overlay, component)
    c, ns = p.c, p.ns
    mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
    if ns.model.startswith(DEMO_MODEL_PREFIX):
        assert c["image"].endswith("-demo"), f"{ns.model} exists only in a DEMO_MODEL=1 image"
        dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
        assert f"model prepare --out {ns.model}" in dockerfile
    else:
        assert any(ns.model.startswith(m) for m in mounts), f"{ns.model} is in no volume"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_settings_are_valid_and_shared(overlay, tmp_path):
    # The engine's own checks, on a stand-in model directory (only config.json
    # is read), for every component's settings.
    model = write_config_dir(
        tmp_path, {**TINY_CONFIGS["llama"], "max_position_embeddings": 1 << 20}
    )
    parsed = {c: setup(overlay, c).ns for c in COMPONENTS}
    configs = {
        c: EngineConfig.from_kwargs(str(model), **engine_kwargs(parsed[c]))
        for c in ("prefill", "decode")
    }
    router = parsed["router"]
    for c, config in configs.items():
        assert config.kvcache_block_size == router.kvcache_block_size, c
        assert parsed[c].served_model_name == router.served_model_name, c
        assert parsed[c].max_model_len == router.max_model_len, c
        assert parsed[c].model == router.model, c


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_nodes_get_a_gpu_per_rank_shared_memory_and_nccl_settings(overlay):
    docs = render(f"overlays/{overlay}")
    for component in ("prefill", "decode"):
        dep = deployment(docs, component)
        c = container(dep)
        env, _ = container_env(docs, c)
        res = c["resources"]
        gpus = res.get("limits", {}).get("nvidia.com/gpu")
        if env.get("PDSERVE_DEVICE") != "cuda":
            assert gpus is None, f"{overlay}: {component} asks for a GPU it does not use"
            continue
        # One GPU per tensor-parallel rank.
        ranks = int(env.get("PDSERVE_TENSOR_PARALLEL_SIZE", "1"))
        assert gpus == ranks and res["requests"].get("nvidia.com/gpu") == ranks, component
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
        assert {"NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"} <= set(env)


def test_services_and_budgets_select_the_pods_they_mean():
    for overlay in OVERLAYS:
        docs = render(f"overlays/{overlay}")
        deployments = find(docs, "Deployment")
        for dep in deployments:
            labels = dep["spec"]["template"]["metadata"]["labels"]
            selector = dep["spec"]["selector"]["matchLabels"]
            assert selector.items() <= labels.items(), dep["metadata"]["name"]

        for svc in find(docs, "Service"):
            (dep,) = selected(deployments, svc["spec"]["selector"])
            names = ports(container(dep))
            for p in svc["spec"]["ports"]:
                assert p["targetPort"] in names, f"{svc['metadata']['name']}: {p}"
        for pdb in find(docs, "PodDisruptionBudget"):
            (dep,) = selected(deployments, pdb["spec"]["selector"]["matchLabels"])
            assert pdb["metadata"]["name"] == dep["metadata"]["name"]


def secret_refs(dep: dict) -> set[tuple[str, str]]:
    """(Secret, key) pairs a Deployment's pods use, as variables or files."""
    pod = dep["spec"]["template"]["spec"]
    refs = set()
    for c in pod["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.add((ref["name"], ref["key"]))
    for v in pod.get("volumes", []):
        if "secret" in v:
            # Explicit items: the keys the operator must create are spelled out.
            refs |= {(v["secret"]["secretName"], item["key"]) for item in v["secret"]["items"]}
    return refs


def test_secrets_are_referenced_not_committed():
    # Secrets are the operator's to create (docs/operations.md), never in git.
    refs = set()
    for overlay in OVERLAYS:
        docs = render(f"overlays/{overlay}")
        assert not find(docs, "Secret"), overlay
        for d in find(docs, "Deployment"):
            refs |= secret_refs(d)
    assert refs == {
        ("pdserve-redis", "password"),
        ("pdserve-admin", "token"),
        ("pdserve-api-tokens", "tokens"),
    }
    text = (REPO / "docs" / "operations.md").read_text()
    for name, key in refs:
        assert re.search(rf"create secret generic {name} .*--from-(literal|file)={key}=", text), (
            f"docs/operations.md does not say how to create {name} ({key})"
        )


@pytest.mark.parametrize("overlay,component", CASES)
def test_files_named_in_variables_are_mounted(overlay, component):
    # A path in a PDSERVE_* variable (tokens, certificates, ...) must be in a
    # volume; the model may also be baked into a demo image (tested above).
    p = setup(overlay, component)
    mounts = [m["mountPath"].rstrip("/") + "/" for m in p.c.get("volumeMounts", [])]
    for name, value in p.env.items():
        if not name.startswith("PDSERVE_") or not value.startswith("/") or name == "PDSERVE_MODEL":
            continue
        assert any(value.startswith(m) for m in mounts), f"{component}: {name}={value} not mounted"
