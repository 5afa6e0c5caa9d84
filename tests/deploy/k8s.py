"""What the deploy tests share: finding the tools, rendering the overlays, and
reading a container the way the kubelet and `pdserve` would.

No test here skips: a missing kubectl or hadolint fails with what to install
(`make setup` installs both into the virtual environment).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# The components that run `pdserve`; Redis is the other workload.
COMPONENTS = ("router", "prefill", "decode")
# Stand-ins for what the kubelet fills in from the downward API.
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "pod-name-from-downward-api"}


def tool(name: str) -> str:
    """The tool installed beside this Python (by `make setup`), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found beside {sys.executable} nor on PATH: run `make setup`")
    return found


@functools.cache
def kubectl() -> str:
    """A kubectl whose built-in kustomize is v5 (what the overlays are written for)."""
    path = tool("kubectl")
    out = subprocess.run(
        [path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        pytest.fail(f"{path} version failed: {out.stderr.strip()}")
    kustomize = json.loads(out.stdout).get("kustomizeVersion", "")
    if not re.match(r"v[5-9]\.", kustomize):
        pytest.fail(f"{path} has kustomize {kustomize or 'none'}; v5 or newer is needed")
    return path


@functools.cache
def render(directory: str) -> tuple[dict, ...]:
    """`kubectl kustomize` of a directory under deploy/k8s (e.g. "overlays/gpu")."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / directory)], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        pytest.fail(f"kustomize {directory} failed:\n{out.stderr}")
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def load_yaml(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(docs, kind: str, name: str | None = None, component: str | None = None) -> list[dict]:
    out = []
    for d in docs:
        meta = d.get("metadata", {})
        if d.get("kind") != kind or (name is not None and meta.get("name") != name):
            continue
        labels = meta.get("labels", {})
        if component is not None and labels.get("app.kubernetes.io/component") != component:
            continue
        out.append(d)
    return out


def one(docs, kind: str, **kw) -> dict:
    found = find(docs, kind, **kw)
    assert len(found) == 1, f"expected one {kind} {kw}, found {len(found)}"
    return found[0]


def deployment(docs, component: str) -> dict:
    return one(docs, "Deployment", component=component)


def container(dep: dict) -> dict:
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{dep['metadata']['name']}: one container expected"
    return containers[0]


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, `$$` is a `$`."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(sub, value)


def secret_placeholder(name: str, key: str) -> str:
    return f"<secret {name}/{key}>"


def container_env(docs, c: dict) -> tuple[dict[str, str], dict[str, dict]]:
    """The environment the kubelet gives container ``c`` (values of Secrets as
    placeholders), and where each variable came from (its `env` entry)."""
    env: dict[str, str] = {}
    sources: dict[str, dict] = {}
    for src in c.get("envFrom", []):
        ref = src.get("configMapRef")
        assert ref is not None, f"envFrom {src}: only ConfigMaps are expected"
        cm = one(docs, "ConfigMap", name=ref["name"])
        for k, v in cm.get("data", {}).items():
            env[k] = v
            sources[k] = {"configMap": ref["name"]}
    for e in c.get("env", []):
        name = e["name"]
        sources[name] = e
        if "value" in e:
            env[name] = expand(e["value"], env)
            continue
        vf = e["valueFrom"]
        if "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            env[name] = one(docs, "ConfigMap", name=ref["name"])["data"][ref["key"]]
        elif "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            env[name] = secret_placeholder(ref["name"], ref["key"])
        elif "fieldRef" in vf:
            env[name] = FIELD_VALUES[vf["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"{name}: unexpected valueFrom {vf}")
    return env, sources


class RecordingEnv(dict):
    """os.environ's stand-in: remembers every name the code looks up."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def component_module(component: str):
    from decode_node import main as decode_main
    from prefill_node import main as prefill_main
    from router import main as router_main

    return {"router": router_main, "prefill": prefill_main, "decode": decode_main}[component]


def parse_component(component: str, argv: list[str], env: dict[str, str]):
    """Parse ``pdserve <component> argv`` with exactly ``env`` as the environment,
    through the component's own parser; returns (namespace, variables it read)."""
    recording = RecordingEnv(env)
    with mock.patch.object(os, "environ", recording):
        parser = argparse.ArgumentParser(prog=f"pdserve {component}", exit_on_error=False)
        component_module(component).add_arguments(parser)
        try:
            ns = parser.parse_args(argv)
        except (argparse.ArgumentError, SystemExit) as e:
            pytest.fail(f"pdserve {component} {' '.join(argv)}: the code refuses it ({e!r})")
    return ns, recording.read


def pdctl_reads(env: dict[str, str]) -> set[str]:
    """Variables `pdctl` reads (it runs in the router's container: kubectl exec)."""
    from router.admin import pdctl

    recording = RecordingEnv(env)
    with mock.patch.object(os, "environ", recording):
        pdctl.build_parser().parse_args(["nodes"])
    return recording.read


def kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


def resource_files() -> list[Path]:
    """Every whole manifest that a kustomization lists (patches are partial; they
    are checked through the rendered overlays)."""
    files = set()
    for k in kustomizations():
        spec = yaml.safe_load(k.read_text())
        for entry in spec.get("resources", []):
            path = (k.parent / entry).resolve()
            if path.is_file():
                files.add(path)
    return sorted(files)
