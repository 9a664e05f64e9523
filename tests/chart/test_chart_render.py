"""The Helm chart, checked with real tools: ``helm lint``, ``helm template`` in every scenario,
kubernetes-validate (strict) on every rendered manifest, yamllint on the rendered files.

Kinds that kubernetes-validate has no schema for are validated here too: kopf's peering objects
against the CRDs in ``crds/``, the Prometheus Operator's ServiceMonitor and PodMonitor against
a schema of the fields the chart uses (written from the monitoring.coreos.com/v1 API; the
Prometheus Operator's own CRDs are not available offline). What only a cluster proves: that
the API server admits the objects (CEL rules, admission plugins), that the RBAC suffices at run
time, and that Prometheus discovers the targets.
"""

from __future__ import annotations

import ast
import filecmp
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from support.charts import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    ROOT,
    render,
    run,
    tool,
)

KUBERNETES_VERSIONS = ("1.29.0", "1.35.0", kubernetes_validate.utils.latest_version())
ADMISSION_POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
"""Rendered only with node caching's admission policies, which need Kubernetes >= 1.30."""
"""The chart's minimum (Chart.yaml kubeVersion), the helm/kubectl client's, the newest known."""
PEERING_KINDS = {"ClusterKopfPeering", "KopfPeering"}
MONITOR_KINDS = {"ServiceMonitor", "PodMonitor"}
METRIC_NAME = r"modelstage_[a-z_]+"

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": _LABELS,
        "annotations": _LABELS,
    },
}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
}
_NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "any": {"type": "boolean"},
        "matchNames": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}  # fmt: skip
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    "properties": {
        "port": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 15},
        "path": {"type": "string", "pattern": "^/"},
        "interval": _DURATION,
        "scrapeTimeout": _DURATION,
        "honorLabels": {"type": "boolean"},
    },
}


def _monitor_schema(endpoints_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"type": "string"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", endpoints_key],
                "properties": {
                    "selector": _SELECTOR,
                    "namespaceSelector": _NAMESPACE_SELECTOR,
                    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                    endpoints_key: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


MONITOR_SCHEMAS = {
    "ServiceMonitor": _monitor_schema("endpoints"),
    "PodMonitor": _monitor_schema("podMetricsEndpoints"),
}


def _strict(schema: Any) -> Any:
    """A CRD's structural schema as JSON schema that refuses unknown fields (like the API
    server's field validation ``Strict``), except where the CRD preserves unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def _crd_schemas() -> dict[str, dict[str, Any]]:
    """kind -> strict schema of its objects, from every CRD in crds/."""
    schemas: dict[str, dict[str, Any]] = {}
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            spec = crd["spec"]
            (version,) = [v for v in spec["versions"] if v["storage"]]
            schema = _strict(version["schema"]["openAPIV3Schema"])
            schema["properties"] = {
                **schema["properties"],
                "apiVersion": {"const": f"{spec['group']}/{version['name']}"},
                "kind": {"const": spec["names"]["kind"]},
                "metadata": _METADATA,
            }
            schema["required"] = sorted({*schema.get("required", []), "apiVersion", "metadata"})
            if spec["scope"] == "Cluster":
                schema["properties"]["metadata"] = {
                    **_METADATA,
                    "not": {"required": ["namespace"]},
                }
            schemas[spec["names"]["kind"]] = schema
    return schemas


def test_helm_lint_passes_strict_in_every_mode() -> None:
    for args in ([], ["--set", "watch.namespaced=true"], ["--set", "serviceMonitor.enabled=true"]):
        result = run([tool("helm"), "lint", "--strict", str(CHART), *args])
        assert "0 chart(s) failed" in result.stdout


def test_every_rendered_manifest_validates_strictly(
    scenario: str, rendered: list[dict[str, Any]]
) -> None:
    crd_schemas = _crd_schemas()
    assert rendered, f"{scenario}: helm template rendered nothing"
    for doc in rendered:
        kind = doc["kind"]
        where = f"{scenario}: {kind} {doc['metadata'].get('name')}"
        if kind in PEERING_KINDS:
            jsonschema.validate(doc, crd_schemas[kind])
        elif kind in MONITOR_KINDS:
            jsonschema.validate(doc, MONITOR_SCHEMAS[kind])
        else:
            for version in KUBERNETES_VERSIONS:
                if kind in ADMISSION_POLICY_KINDS and version < "1.30":
                    continue  # admissionregistration.k8s.io/v1 policies: 1.30 (the chart says)
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as error:
                    pytest.fail(f"{where} is invalid for Kubernetes {version}: {error.message}")
                except kubernetes_validate.SchemaNotFoundError:
                    pytest.fail(f"{where}: no schema in Kubernetes {version}")


def test_rendered_files_pass_yamllint(scenario: str, tmp_path: Path) -> None:
    from support.charts import SCENARIOS

    run(
        [tool("helm"), "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
         "--output-dir", str(tmp_path), *SCENARIOS[scenario]]
    )  # fmt: skip
    files = sorted(tmp_path.rglob("*.yaml"))
    assert files
    result = run(
        [tool("yamllint"), "--strict", "-f", "parsable", "-c", str(ROOT / ".yamllint.yaml"),
         *map(str, files)],
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_sources_pass_yamllint() -> None:
    files = [CHART / "Chart.yaml", CHART / "values.yaml", ROOT / ".yamllint.yaml"]
    result = run(
        [tool("yamllint"), "--strict", "-c", str(ROOT / ".yamllint.yaml"), *map(str, files)],
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_crds_are_the_repository_crds() -> None:
    repo = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    chart = sorted(p.name for p in (CHART / "crds").iterdir())
    assert chart == repo, "the chart's crds/ must hold exactly the files of crds/"
    stale = [n for n in repo if not filecmp.cmp(ROOT / "crds" / n, CHART / "crds" / n, False)]
    assert not stale, (
        f"charts/modelstage/crds is stale: run `cp crds/*.yaml {CHART.relative_to(ROOT)}/crds/` ({stale})"
    )


def test_crds_validate_strictly() -> None:
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_helm_installs_the_crds_with_the_chart() -> None:
    """``--include-crds`` is what ``helm install`` applies first; every CRD is there."""
    text = run(
        [tool("helm"), "template", RELEASE, str(CHART), "--include-crds", "-n", RELEASE_NAMESPACE]
    ).stdout
    names = {
        d["metadata"]["name"]
        for d in yaml.safe_load_all(text)
        if d and d["kind"] == "CustomResourceDefinition"
    }
    assert names == {
        "modeldeployments.modelstage.io",
        "nodecaches.modelstage.io",
        "clusterkopfpeerings.kopf.dev",
        "kopfpeerings.kopf.dev",
    }


def test_kube_version_floor_is_enforced() -> None:
    base = [tool("helm"), "template", RELEASE, str(CHART)]
    assert run([*base, "--kube-version", "1.29.0"], check=False).returncode == 0
    old = run([*base, "--kube-version", "1.28.9"], check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "replicas=2"], "additional properties 'replicas' not allowed"),
        (["--set", "watch.namespaced=yes"], "want boolean"),
        (["--set", "operator.metricsPort=0"], "minimum"),
        (["--set", "watch.namespaces={Bad_Name}"], "does not match pattern"),
        (["--set", "operator.logFormat=xml"], "value must be one of"),
    ],
)
def test_values_schema_refuses_bad_values(values: list[str], message: str) -> None:
    result = run([tool("helm"), "template", RELEASE, str(CHART), *values], check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_service_monitor_needs_the_metrics_service() -> None:
    result = run(
        [tool("helm"), "template", RELEASE, str(CHART), "--set", "serviceMonitor.enabled=true",
         "--set", "metricsService.enabled=false"],
        check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "needs metricsService.enabled" in result.stderr


def test_notes_tell_the_next_step_and_the_crd_upgrade() -> None:
    notes = run(
        [tool("helm"), "install", RELEASE, str(CHART), "--dry-run=client", "-n", RELEASE_NAMESPACE]
    ).stdout.split("NOTES:", 1)[1]
    assert f"rollout status deployment/{RELEASE}-modelstage" in notes
    assert "kubectl apply -n <namespace> -f examples/modeldeployment-sharded-state.yaml" in notes
    assert "kubectl apply --server-side -f <chart>/crds/" in notes
    assert "not leader election" in notes
    assert "modelstage.io/model-deployment: <name>" in notes  # the workload's opt-in


def test_dashboard_is_valid_json_and_only_queries_exported_metrics() -> None:
    (configmap,) = [
        d
        for d in render("default")
        if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]
    ]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["modelstage.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "modelstage.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"\bmodelstage_[a-z_]+", e)}
    exported = _exported_metrics()
    assert queried <= exported, f"not exported by any module: {sorted(queried - exported)}"
    assert any(m.startswith("modelstage_load_") for m in queried)
    assert any(m.startswith("modelstage_operator_") for m in queried)
    node_cache = {m for m in queried if m.startswith("modelstage_node_cache_")}
    assert {"modelstage_node_cache_bytes_held", "modelstage_node_cache_budget_bytes",
            "modelstage_node_cache_copy_bytes_per_second", "modelstage_node_cache_evictions_total",
            "modelstage_node_cache_pod_starts_total", "modelstage_node_cache_load_total",
            "modelstage_node_cache_nodes"} <= node_cache  # fmt: skip
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def _exported_metrics() -> set[str]:
    """Metric names as Prometheus sees them, from the metric definitions in the source: a call
    whose first argument names a ``modelstage_*`` metric (prometheus-client's classes, the
    collectors' metric families, a module's own helper around them). A counter is exposed as
    ``x_total``, a histogram as ``x_bucket``, ``x_sum`` and ``x_count``."""
    names: set[str] = set()
    for folder in sorted(ROOT.glob("*/modelstage")):
        for path in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and node.args):
                    continue
                first = node.args[0]
                if not (isinstance(first, ast.Constant) and isinstance(first.value, str)
                        and re.fullmatch(METRIC_NAME, first.value)):  # fmt: skip
                    continue
                name, kind = first.value, ast.unparse(node.func)
                if "Counter" in kind:
                    names.add(name if name.endswith("_total") else f"{name}_total")
                elif "Histogram" in kind:
                    names |= {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                elif "Summary" in kind:
                    names |= {name, f"{name}_sum", f"{name}_count"}
                else:
                    names.add(name)
    return names
