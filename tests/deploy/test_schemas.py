"""Every manifest, and what every overlay renders to, is valid Kubernetes.

Offline: kubernetes-validate carries the API's JSON schemas. Strict schemas
refuse unknown fields, so a misspelt field fails here rather than being
silently dropped by the API server. Checked against the oldest release the
manifests support (gRPC probes are GA from 1.27) and the newest one bundled.
"""

from __future__ import annotations

import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions

from tests.deploy.k8s import K8S, OVERLAYS, load_yaml, render, resource_files

OLDEST = "1.27"
VERSIONS = (OLDEST, all_versions()[-1])


def validate(doc: dict, version: str, where: str) -> None:
    name = f"{where}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(str(p) for p in e.path)
        pytest.fail(f"{name} is invalid for Kubernetes {version} at {path}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{name}: {e.message}")


def test_the_resource_files_are_found():
    names = {p.name for p in resource_files()}
    assert {"redis.yaml", "router.yaml", "prefill.yaml", "decode.yaml"} <= names


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", resource_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_resource_file_is_valid(path, version):
    docs = load_yaml(path)
    assert docs, f"{path} holds no manifest"
    for doc in docs:
        validate(doc, version, str(path.relative_to(K8S)))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("directory", ["base"] + [f"overlays/{o}" for o in OVERLAYS])
def test_rendered_output_is_valid(directory, version):
    docs = render(directory)
    assert docs
    for doc in docs:
        validate(doc, version, directory)


def test_strict_validation_catches_a_misspelt_field():
    # The point of strict schemas: an unknown field is an error, not a no-op.
    doc = next(d for d in render("overlays/cpu-demo") if d["kind"] == "Deployment")
    broken = {**doc, "spec": {**doc["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)
