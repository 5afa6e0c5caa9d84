"""Every workload the overlays render is locked down and sized: non-root, no
privilege escalation, no capabilities, the runtime's seccomp profile, requests
and limits, no service-account token, no service-link variables."""

from __future__ import annotations

import pytest

from tests.deploy.k8s import OVERLAYS, find, render


def workloads():
    for overlay in OVERLAYS:
        for dep in find(render(f"overlays/{overlay}"), "Deployment"):
            yield pytest.param(dep, id=f"overlay-{overlay}-{dep['metadata']['name']}")


@pytest.mark.parametrize("dep", list(workloads()))
def test_pod_is_locked_down(dep):
    pod = dep["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostIPC") and not pod.get("hostPID")
    for c in pod["containers"] + pod.get("initContainers", []):
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False, c["name"]
        assert csc["capabilities"]["drop"] == ["ALL"] and not csc["capabilities"].get("add")
        assert not csc.get("privileged"), c["name"]


@pytest.mark.parametrize("dep", list(workloads()))
def test_containers_have_requests_and_limits(dep):
    pod = dep["spec"]["template"]["spec"]
    for c in pod["containers"] + pod.get("initContainers", []):
        res = c["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(res[kind]), (c["name"], kind)
