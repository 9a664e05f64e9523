"""The NodeCache CRD: generated from ``modelstage.api.nodecache`` (fresh in crds/ and the chart),
accepted by Kubernetes, structural, cluster-scoped with a status subresource, and accepting
what the agent writes."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from modelstage.api import crd
from modelstage.api.nodecache import (
    Grant,
    HeldCopy,
    NodeCacheReport,
    NodeCacheSpec,
    PartialCopy,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "modelstage.io_nodecaches.yaml"
KUBERNETES_VERSIONS = ["1.29.0", "1.31.0", "1.33.0", kubernetes_validate.latest_version()]


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CRD_FILE.read_text())
    return loaded


def test_committed_crd_is_what_the_models_generate() -> None:
    assert CRD_FILE.read_text() == crd.render("nodecaches"), (
        "crds/ is stale: run `python -m modelstage.api.crd nodecaches > "
        "crds/modelstage.io_nodecaches.yaml` and copy it to charts/modelstage/crds/"
    )
    assert (ROOT / "charts" / "modelstage" / "crds" / CRD_FILE.name).read_text() == CRD_FILE.read_text()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_passes_kubernetes_validate(document: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(document, version, strict=True)


def test_cluster_scoped_with_status_and_printer_columns(document: dict[str, Any]) -> None:
    spec = document["spec"]
    assert spec["scope"] == "Cluster" and spec["names"]["kind"] == "NodeCache"
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Held", "Free", "Budget", "Copies", "Heartbeat"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    for column in version["additionalPrinterColumns"]:
        field = column["jsonPath"].removeprefix(".status.").split("[")[0].split(".")[0]
        assert field in status["properties"], column


def test_schema_is_structural(document: dict[str, Any]) -> None:
    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(document["spec"]["versions"][0]["schema"], "schema")


def test_the_agents_report_and_the_operators_spec_validate(document: dict[str, Any]) -> None:
    now = datetime.now(UTC)
    grant = Grant(namespace="team-a", digest="ab" * 10)
    report = NodeCacheReport(
        node="n1", root="/var/lib/modelstage/node-cache", budget_bytes=10, bytes_held=5,
        free_bytes=7, endpoint="http://10.0.0.7:9103", heartbeat=now,
        copies=[HeldCopy(content="ef" * 16, label="cache.modelstage.io/" + "0" * 20, bytes=4,
                         files=2, copied_at=now, copy_seconds=1.5, last_used=now,
                         last_verified=now, pinned=True, warm=True, warmed_at=now,
                         grants=[grant])],
        partial=[PartialCopy(content="cd" * 16, bytes=1, copying=True)], evictions=1,
        verify_failures=2, copy_bytes_per_second=2.5, message="over budget",
    )  # fmt: skip
    spec = NodeCacheSpec(keep=[grant], warm=[grant])
    body = {"apiVersion": "modelstage.io/v1alpha1", "kind": "NodeCache",
            "metadata": {"name": "n1"},
            "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True),
            "status": report.model_dump(mode="json", by_alias=True, exclude_none=True)}  # fmt: skip
    schema = document["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft7Validator(schema).validate(body)
    assert NodeCacheReport.model_validate(body["status"]) == report
    assert NodeCacheSpec.model_validate(body["spec"]) == spec
    status = body["status"]
    assert set(status["copies"][0]) >= {"content", "label", "bytes", "lastVerified", "grants"}
    assert {"freeBytes", "endpoint", "verifyFailures", "bytesHeld"} <= set(status)
