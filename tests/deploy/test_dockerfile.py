"""deploy/Dockerfile, without building it (CI has no Docker daemon): hadolint,
then what the manifests and the code rely on: the base, the user, the entry
point, the ports, the packages copied in.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest

from tests.deploy.k8s import (
    COMPONENTS,
    DEPLOY,
    OVERLAYS,
    REPO,
    container,
    container_env,
    deployment,
    find,
    parse_component,
    ports,
    render,
    tool,
)

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def stages() -> tuple[dict[str, str], list[tuple[str, str, list]]]:
    """Global ARG defaults, and (name, FROM image, instructions) per stage."""
    global_args, result = {}, []
    for word, rest in instructions():
        if word == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            result.append((m.group(2) or "", m.group(1), []))
        elif not result and word == "ARG":
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            result[-1][2].append((word, rest))
    return global_args, result


def final_stage():
    return stages()[1][-1]


def test_hadolint_passes():
    out = subprocess.run(
        [tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_image_is_built_on_a_cuda_runtime_base():
    global_args, all_stages = stages()
    by_name = {name: image for name, image, _ in all_stages}
    image = final_stage()[1]
    while image in by_name:  # follow stage -> stage down to the external image
        image = by_name[image]
    image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], image)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", image), image


def test_it_runs_as_the_non_root_user_the_manifests_name():
    user = [rest for word, rest in final_stage()[2] if word == "USER"]
    assert user, "the final stage sets no USER"
    uid, _, gid = user[-1].partition(":")
    # Numeric, so that the kubelet's runAsNonRoot can check it without /etc/passwd.
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit(), user[-1]
    for overlay in OVERLAYS:
        docs = render(f"overlays/{overlay}")
        for component in COMPONENTS:
            pod = deployment(docs, component)["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsUser"] == int(uid), (overlay, component)
            assert pod["securityContext"]["runAsGroup"] == int(gid), (overlay, component)


def test_entry_point_is_the_command_the_manifests_run():
    entry = [rest for word, rest in final_stage()[2] if word == "ENTRYPOINT"]
    assert json.loads(entry[-1]) == ["pdserve"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "pdserve" in scripts
    for overlay in OVERLAYS:
        for component in COMPONENTS:
            c = container(deployment(render(f"overlays/{overlay}"), component))
            assert c["command"] == ["pdserve"]


def test_exposed_ports_are_the_code_defaults_and_the_manifests_ports():
    exposed = {int(p) for word, rest in final_stage()[2] if word == "EXPOSE" for p in rest.split()}
    defaults = set()
    for component in COMPONENTS:
        ns, _ = parse_component(component, [], {})
        defaults.add(ns.port)
        defaults |= {getattr(ns, a) for a in ("admin_port", "transfer_port") if hasattr(ns, a)}
    assert defaults <= exposed, f"code defaults {sorted(defaults - exposed)} not exposed"
    declared = set()
    for overlay in OVERLAYS:
        for component in COMPONENTS:
            declared |= set(
                ports(container(deployment(render(f"overlays/{overlay}"), component))).values()
            )
    assert exposed == declared, f"EXPOSE {sorted(exposed)} vs manifests {sorted(declared)}"


def test_every_package_is_copied_in_and_not_ignored():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = {rest.split()[0] for stage in stages()[1] for word, rest in stage[2] if word == "COPY"}
    assert packages <= copied, f"not copied: {sorted(packages - copied)}"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for name in sorted(packages) + ["pyproject.toml", "README.md"]:
        assert any(line in (f"!{name}", f"!{name}/**") for line in ignore), name


def test_writable_paths_are_volumes_on_a_read_only_root():
    # HOME and Triton's cache are under /tmp in the image; the pods' root file
    # system is read-only, so /tmp must be a volume there.
    env = " ".join(rest for word, rest in final_stage()[2] if word == "ENV")
    assert "HOME=/tmp" in env and "TRITON_CACHE_DIR=/tmp/" in env
    for overlay in OVERLAYS:
        docs = render(f"overlays/{overlay}")
        for dep in find(docs, "Deployment"):
            for c in dep["spec"]["template"]["spec"]["containers"]:
                assert c["securityContext"]["readOnlyRootFilesystem"] is True
                if c["image"].startswith("pdserve"):
                    mounts = {m["mountPath"] for m in c["volumeMounts"]}
                    assert "/tmp" in mounts, (overlay, c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"overlay-{o}" for o in OVERLAYS])
def test_demo_image_holds_the_model_the_overlay_names(overlay):
    docs = render(f"overlays/{overlay}")
    c = container(deployment(docs, "router"))
    env, _ = container_env(docs, c)
    baked = re.search(r"model prepare --out (\S+)", DOCKERFILE.read_text()).group(1)
    assert (env["PDSERVE_MODEL"] == baked) == c["image"].endswith("-demo"), (overlay, baked)
