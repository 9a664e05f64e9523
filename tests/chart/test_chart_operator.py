"""The operator Deployment the chart renders, against what the operator code expects.

The rendered arguments go through the operator's own argument parser
(``modelstage.operator.__main__.parse_args``) and the rendered environment through its own
settings reader (``OperatorConfig.from_env``), so a renamed flag or variable fails here, not in
a cluster. Peering, monitors and labels are checked against the constants the operator uses.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from modelstage.operator import settings as operator_settings
from modelstage.operator.__main__ import parse_args
from modelstage.operator.settings import OperatorConfig
from support.charts import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    is_namespaced,
    of_kind,
    one,
    render,
    run,
    tool,
)

NODE_CACHE_ROOT_ENV = "MODELSTAGE_NODE_CACHE_ROOT"
"""The node root on the host (node caching; test_chart_node_cache.py checks its value)."""


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return dict(container)


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = one(docs, "Deployment")["spec"]["template"]["spec"]
    return pod


def test_one_replica_with_the_recreate_strategy(rendered: list[dict[str, Any]]) -> None:
    spec = one(rendered, "Deployment")["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def test_pod_security_is_restricted(rendered: list[dict[str, Any]]) -> None:
    pod = _pod(rendered)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = _container(rendered)["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in security
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    mounts = {m["mountPath"] for m in _container(rendered)["volumeMounts"]}
    assert "/tmp" in mounts, "a read-only root filesystem needs a writable /tmp"


def test_probes_hit_kopfs_liveness_endpoint(rendered: list[dict[str, Any]]) -> None:
    container = _container(rendered)
    args = parse_args(container["args"])
    liveness = urlparse(args.liveness)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert liveness.port == ports["health"]
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == (liveness.path, "health")
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_arguments_parse_with_the_operators_parser(scenario: str) -> None:
    docs = render(scenario)
    args = parse_args(_container(docs)["args"])
    namespaced = is_namespaced(scenario)
    if scenario == "namespaced":
        assert args.namespaces == ["team-a", "team-b"]
    elif namespaced:
        assert args.namespaces == [RELEASE_NAMESPACE]
    else:
        assert args.all_namespaces and not args.namespaces
    assert args.standalone == ("no-peering" in scenario)
    assert args.log_format == "json"


def test_environment_is_what_the_operator_reads(rendered: list[dict[str, Any]]) -> None:
    container = _container(rendered)
    env = {e["name"]: e.get("value") for e in container["env"]}
    ours = {k for k in env if k.startswith("MODELSTAGE_")} - {NODE_CACHE_ROOT_ENV}
    assert ours and all(k.startswith(operator_settings.PREFIX) for k in ours)
    config = OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.metrics_port == ports["metrics"]
    assert config.stager_image == "ghcr.io/modelstage/stager:0.1.0"
    assert config.stager_images == (config.stager_image,), "only the chart's image by default"
    assert (config.max_stager_jobs, config.max_stager_jobs_per_namespace) == (4, 2)


def test_allowed_stager_images_reach_the_operator() -> None:
    text = run([tool("helm"), "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
                "--set", "stagerImage.allowed={registry.local/stager,ghcr.io/acme/stager:2}"]).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(text) if d]
    env = {e["name"]: e.get("value") for e in _container(docs)["env"]}
    config = OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert config.stager_images == (
        "ghcr.io/modelstage/stager:0.1.0", "registry.local/stager", "ghcr.io/acme/stager:2"
    )


def test_peering_object_matches_the_operators_peering(scenario: str) -> None:
    docs = render(scenario)
    peerings = of_kind(docs, "ClusterKopfPeering") + of_kind(docs, "KopfPeering")
    if "no-peering" in scenario:
        assert not peerings
        return
    assert {p["metadata"]["name"] for p in peerings} == {operator_settings.PEERING_NAME}
    args = parse_args(_container(docs)["args"])
    if args.all_namespaces:
        assert [p["kind"] for p in peerings] == ["ClusterKopfPeering"]
    else:
        # kopf uses a KopfPeering in each namespace it serves.
        assert all(p["kind"] == "KopfPeering" for p in peerings)
        assert sorted(p["metadata"]["namespace"] for p in peerings) == sorted(args.namespaces)


def test_metrics_service_and_service_monitor_reach_the_metrics_port() -> None:
    docs = render("monitoring")
    service = one(docs, "Service")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics"
    monitor = one(docs, "ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [port["name"]]


def test_no_pod_monitor_scrapes_stager_pods_which_serve_no_metrics() -> None:
    """A monitor of a port the stager never opens would only ever report targets down."""
    from modelstage.api.modeldeployment import ModelDeploymentSpec
    from modelstage.api.objects import Owner
    from modelstage.operator.artifact import artifact_at
    from modelstage.operator.job_plan import plan_stage_job

    for scenario in ("monitoring", "namespaced-monitoring-no-peering"):
        for monitor in of_kind(render(scenario), "PodMonitor"):
            selector = monitor["spec"]["selector"].get("matchLabels") or {}
            assert selector.get("app.kubernetes.io/component") != "stager"
    spec = ModelDeploymentSpec.model_validate({
        "model": {"uri": "hf://acme/llama"}, "storage": {"pvc": {"claimName": "models"}},
        "serving": {"targetRef": {"name": "vllm"}}, "loadFormat": "sharded_state",
    })  # fmt: skip
    owner = Owner("llama", "ns", "uid")
    job = plan_stage_job(spec, owner=owner, artifact=artifact_at(spec, namespace=owner.namespace, deployment_name=owner.name, digest="0" * 20))
    assert all("ports" not in c for c in job["spec"]["template"]["spec"]["containers"])


def test_resolve_interval_and_stager_logs_reach_the_operator() -> None:
    env = {e["name"]: e.get("value") for e in
           one(render("stager-progress-from-logs"), "Deployment")["spec"]["template"]["spec"][
               "containers"][0]["env"]}  # fmt: skip
    config = OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert (config.resolve_interval, config.stager_logs) == (3600.0, True)
    default = {e["name"]: e.get("value") for e in
               one(render("default"), "Deployment")["spec"]["template"]["spec"][
                   "containers"][0]["env"]}  # fmt: skip
    config = OperatorConfig.from_env({k: v for k, v in default.items() if v is not None})
    assert (config.resolve_interval, config.stager_logs) == (0.0, False)


def test_vllm_loader_pod_monitor_scrapes_one_port_per_rank() -> None:
    docs = render("monitoring")
    (monitor,) = [
        m for m in of_kind(docs, "PodMonitor") if m["metadata"]["name"].endswith("-vllm-loader")
    ]
    ports = [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
    assert ports == ["ms-load-0", "ms-load-1", "ms-load-2", "ms-load-3"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}


@pytest.mark.parametrize("scenario_name", ["default", "namespaced", "namespaced-release-namespace"])
def test_namespaced_mode_needs_nothing_cluster_scoped(scenario_name: str) -> None:
    docs = render(scenario_name)
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"}
    assert not [d["kind"] for d in docs if d["kind"] in cluster_scoped]
    assert of_kind(docs, "Role") and of_kind(docs, "RoleBinding")


def test_endpoints_bind_the_pods_ip_not_every_address(rendered: list[dict[str, Any]]) -> None:
    container = _container(rendered)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["MODELSTAGE_OPERATOR_METRICS_HOST"]["value"] == "$(POD_IP)"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("MODELSTAGE_OPERATOR_METRICS_HOST")
    assert urlparse(parse_args(container["args"]).liveness).hostname == "$(pod_ip)"
    assert "0.0.0.0" not in str(container)


def test_a_network_policy_admits_metrics_from_the_monitoring_namespace_only(
    rendered: list[dict[str, Any]],
) -> None:
    (policy,) = [
        p
        for p in of_kind(rendered, "NetworkPolicy")
        if p["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    pod_labels = one(rendered, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for p in _container(rendered)["ports"]}
    rules = {r["ports"][0]["port"]: r for r in policy["spec"]["ingress"]}
    assert set(rules) == ports == {"metrics", "health"}
    assert rules["metrics"]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
