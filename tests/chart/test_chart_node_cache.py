"""Node caching in the chart: the agent DaemonSet, its RBAC, the operator's side, the values.

What the agent may write is the security boundary of node caching: a process on every serving
node, with a hostPath. Its role is compared with an exact table (every rule and its reason are in
templates/node-cache-rbac.yaml); the write verbs are checked on their own, so that a widened
rule fails with the verb named. The names the parts share (the mount, the default root, the
NodeCache API) come from ``modelstage.core.node_cache``, the uid from the operator's copy Jobs.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from chart.test_chart_rbac import Triple, bound_to, granted, operator_account
from modelstage.core import node_cache
from modelstage.operator.kube import NONROOT_UID
from support.charts import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    SCENARIOS,
    is_namespaced,
    of_kind,
    one,
    render,
    render_docs,
    run,
    tool,
)

AGENT = f"{RELEASE}-modelstage-node-agent"
OPERATOR_NODE_CACHE_ROLE = f"{RELEASE}-modelstage-node-cache"
ENABLED = ("--set", "nodeCache.enabled=true")
GROUP, PLURAL = node_cache.API_GROUP, node_cache.PLURAL

AGENT_RULES: set[Triple] = {
    ("authentication.k8s.io", "tokenreviews", "create"),
    (GROUP, PLURAL, "get"),
    (GROUP, PLURAL, "watch"),
    (GROUP, PLURAL, "create"),
    (GROUP, f"{PLURAL}/status", "patch"),
    ("", "nodes", "get"),
    ("", "nodes", "patch"),
}
"""The agent's permissions, exactly what its code calls (test_chart_node_cache_parts.py
derives that from its source): review copy Jobs' tokens, read, watch and create its NodeCache
and patch its status, read and label its node. No ModelDeployment."""
AGENT_WRITES: set[Triple] = {
    ("authentication.k8s.io", "tokenreviews", "create"),
    (GROUP, PLURAL, "create"),
    (GROUP, f"{PLURAL}/status", "patch"),
    ("", "nodes", "patch"),
}
"""All it may change: its own NodeCache (created once), that object's status, and its node's
labels (the node and the label prefix are enforced by the admission policy: RBAC cannot); a
TokenReview changes nothing."""
OPERATOR_NODE_CACHE_RULES: set[Triple] = {
    ("", "nodes", "list"),
    (GROUP, PLURAL, "list"),
    (GROUP, PLURAL, "watch"),
    (GROUP, PLURAL, "patch"),
    ("", "persistentvolumes", "create"),
    ("", "persistentvolumes", "list"),
    ("", "persistentvolumes", "watch"),
    ("", "persistentvolumes", "delete"),
}
"""The operator's node-cache role (test_chart_rbac.py checks it against the operator's code)."""
READ_VERBS = {"get", "list", "watch"}
NODE_CACHE_SCENARIOS = sorted(s for s in SCENARIOS if "nodeCache.enabled=true" in SCENARIOS[s])


def _agent_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod: dict[str, Any] = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return pod


def _agent_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _agent_pod(docs)["containers"]
    return dict(container)


def _args(container: dict[str, Any]) -> dict[str, str]:
    """``--name=value`` arguments after the subcommand, as a dict."""
    assert container["args"][0] == "agent"
    pairs = [arg.removeprefix("--").split("=", 1) for arg in container["args"][1:]]
    return {name: value for name, value in pairs}


def _operator_env(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.fixture(params=NODE_CACHE_SCENARIOS)
def enabled(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_the_scenarios_cover_node_caching_in_both_modes() -> None:
    assert {is_namespaced(s) for s in NODE_CACHE_SCENARIOS} == {True, False}


def test_off_by_default_renders_nothing_of_it() -> None:
    docs = render_docs("--set", "podMonitor.nodeAgent.enabled=true")
    assert not of_kind(docs, "DaemonSet")
    names = {d["metadata"]["name"] for d in docs}
    assert AGENT not in names and OPERATOR_NODE_CACHE_ROLE not in names
    assert "MODELSTAGE_NODE_CACHE_ROOT" not in _operator_env(docs)
    triples, _ = granted(docs)
    assert not [t for t in triples if t[1] in ("nodes", PLURAL, f"{PLURAL}/status")]


def test_the_defaults_are_the_shared_names() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["nodeCache"]["enabled"] is False
    assert values["nodeCache"]["root"] == node_cache.DEFAULT_ROOT


def test_the_agent_runs_on_its_node_with_the_root_where_the_copy_jobs_mount_it(
    enabled: tuple[str, list[dict[str, Any]]],
) -> None:
    scenario, docs = enabled
    root = dict(a.split("=", 1) for a in SCENARIOS[scenario][1::2]).get(
        "nodeCache.root", node_cache.DEFAULT_ROOT
    )
    pod = _agent_pod(docs)
    container = _agent_container(docs)
    args = _args(container)
    assert args["node"] == "$(NODE_NAME)"
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert args["root"] == node_cache.POD_MOUNT
    assert args["metrics-port"] == str(container["ports"][0]["containerPort"])
    assert container["ports"][0]["name"] == "metrics"
    # One hostPath, the root, mounted where the copy Jobs and serving pods mount it.
    host_paths = [v for v in pod["volumes"] if "hostPath" in v]
    assert host_paths == [
        {"name": "node-cache", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}
    ]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["node-cache"]["mountPath"] == node_cache.POD_MOUNT
    assert not mounts["node-cache"].get("readOnly"), "the agent evicts copies"
    assert [v for v in pod["volumes"] if "hostPath" not in v] == [
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}
    ]
    assert _operator_env(docs)["MODELSTAGE_NODE_CACHE_ROOT"] == root


def test_the_agent_is_non_root_read_only_and_unprivileged(
    enabled: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = enabled
    pod = _agent_pod(docs)
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(key)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == NONROOT_UID, "the copy Jobs' user"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = _agent_container(docs)["securityContext"]
    assert context == {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def test_the_init_container_only_chowns_the_root_with_chown_alone(
    enabled: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = enabled
    (init,) = _agent_pod(docs)["initContainers"]
    # Not recursive, only the mount point, to the user the agent and the copy Jobs run as.
    assert init["command"] == ["chown", f"{NONROOT_UID}:{NONROOT_UID}", node_cache.POD_MOUNT]
    assert "args" not in init
    assert init["securityContext"] == {
        "runAsNonRoot": False,
        "runAsUser": 0,
        "runAsGroup": 0,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert init["volumeMounts"] == [{"name": "node-cache", "mountPath": node_cache.POD_MOUNT}]
    assert init["image"] == _agent_container(docs)["image"]


def test_the_agent_runs_on_its_own_image_not_the_stagers() -> None:
    docs = render_docs(*ENABLED, "--set", "stagerImage.repository=registry.local/stager",
                       "--set", "stagerImage.tag=1.2")  # fmt: skip
    assert _agent_container(docs)["image"] == "ghcr.io/modelstage/agent:0.1.0"
    docs = render_docs(*ENABLED, "--set", "nodeCache.agent.image.tag=1.3")
    assert _agent_container(docs)["image"] == "ghcr.io/modelstage/agent:1.3"
    docs = render_docs(*ENABLED, "--set", "nodeCache.agent.image.repository=registry.local/agent")
    assert _agent_container(docs)["image"] == "registry.local/agent:0.1.0"


def test_values_reach_the_agent() -> None:
    docs = render("node-cache-cluster-wide")  # bytes, a selector, a toleration, a priority
    pod = _agent_pod(docs)
    assert _args(_agent_container(docs))["budget"] == "1500000000000", "not 1.5e+12"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["priorityClassName"] == "system-node-critical"
    docs = render_docs(*ENABLED, "--set", "nodeCache.agent.budget=1.5Ti",
                       "--set", "nodeCache.agent.interval=5",
                       "--set", "nodeCache.agent.metricsPort=9300")  # fmt: skip
    args = _args(_agent_container(docs))
    assert (args["budget"], args["interval"], args["metrics-port"]) == ("1.5Ti", "5", "9300")
    resources = _agent_container(render("node-cache"))["resources"]
    assert "memory" not in resources.get("limits", {}), "a limit would evict warmed pages"


def test_the_agents_role_is_exactly_its_table_and_writes_only_its_report_and_labels(
    enabled: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = enabled
    roles = bound_to(docs, AGENT)
    assert [(r["kind"], r["metadata"]["name"]) for r in roles] == [("ClusterRole", AGENT)]
    triples, wildcards = granted(docs, roles)
    assert not wildcards
    assert triples == AGENT_RULES
    writes = {t for t in triples if t[2] not in READ_VERBS}
    assert writes == AGENT_WRITES
    for rule in roles[0]["rules"]:
        assert not rule.get("resourceNames"), "a role cannot name the agent's own node"


def test_the_agents_account_is_its_own_and_bound_once(
    enabled: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = enabled
    assert _agent_pod(docs)["serviceAccountName"] == AGENT
    assert operator_account(docs) != AGENT
    accounts = {a["metadata"]["name"]: a for a in of_kind(docs, "ServiceAccount")}
    assert accounts[AGENT]["metadata"]["namespace"] == RELEASE_NAMESPACE
    subjects = [
        (b["kind"], b["metadata"]["name"])
        for b in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding")
        if any(s["name"] == AGENT for s in b["subjects"])
    ]
    assert subjects == [("ClusterRoleBinding", AGENT)]
    (binding,) = [b for b in of_kind(docs, "ClusterRoleBinding") if b["metadata"]["name"] == AGENT]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": AGENT, "namespace": RELEASE_NAMESPACE}
    ]
    assert binding["roleRef"]["name"] == AGENT


def test_the_operator_reads_nodes_and_reports_cluster_wide_in_both_modes(
    enabled: tuple[str, list[dict[str, Any]]],
) -> None:
    """Nodes, NodeCaches and PVs are cluster-scoped: a Role could not grant them."""
    _, docs = enabled
    roles = [
        r
        for r in bound_to(docs, operator_account(docs))
        if r["metadata"]["name"] == OPERATOR_NODE_CACHE_ROLE
    ]
    assert [r["kind"] for r in roles] == ["ClusterRole"]
    triples, _ = granted(docs, roles)
    assert triples == OPERATOR_NODE_CACHE_RULES
    everything, _ = granted(docs, bound_to(docs, operator_account(docs)))
    assert not [t for t in everything if t[1] in ("nodes", f"{PLURAL}/status")
                and t[2] not in READ_VERBS]  # fmt: skip
    # Of a NodeCache the operator writes the spec alone (merge patch); never its status,
    # never creates or deletes one.
    assert [t for t in everything if t[1] == PLURAL and t[2] not in READ_VERBS] == [
        (GROUP, PLURAL, "patch")
    ]


def test_the_agent_pods_are_selected_only_by_their_own_objects(
    enabled: tuple[str, list[dict[str, Any]]],
) -> None:
    """The operator's Service and NetworkPolicy must not pick the agents up, nor the agent's
    monitor and policy the operator."""
    _, docs = enabled
    agent_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    operator_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]

    def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
        return selector.items() <= labels.items()

    for service in of_kind(docs, "Service"):
        assert not selects(service["spec"]["selector"], agent_labels)
    policies = {p["metadata"]["name"]: p for p in of_kind(docs, "NetworkPolicy")}
    agent_policy = policies.pop(AGENT)
    assert selects(agent_policy["spec"]["podSelector"]["matchLabels"], agent_labels)
    assert not selects(agent_policy["spec"]["podSelector"]["matchLabels"], operator_labels)
    for policy in policies.values():
        assert not selects(policy["spec"]["podSelector"]["matchLabels"], agent_labels)
    assert agent_policy["spec"]["policyTypes"] == ["Ingress"]
    assert [r["ports"] for r in agent_policy["spec"]["ingress"]] == [
        [{"port": "metrics", "protocol": "TCP"}],
        [{"port": "copy", "protocol": "TCP"}],  # copy Jobs, from the tenants' namespaces
    ]
    (monitor,) = [m for m in of_kind(docs, "PodMonitor") if m["metadata"]["name"] == AGENT]
    assert selects(monitor["spec"]["selector"]["matchLabels"], agent_labels)
    assert not selects(monitor["spec"]["selector"]["matchLabels"], operator_labels)
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "nodeCache.root=/"], "does not match pattern"),
        (["--set", "nodeCache.root=var/lib/cache"], "does not match pattern"),
        (["--set", "nodeCache.root=/var/lib/modelstage/"], "does not match pattern"),
        (["--set", "nodeCache.root=/var/lib/../../etc"], "does not match pattern"),
        (["--set", "nodeCache.root=/var/lib/modelstage/./x"], "does not match pattern"),
        (["--set", "nodeCache.agent.budget=lots"], "does not match pattern"),
        (["--set", "nodeCache.agent.budget=-1"], "/nodeCache/agent/budget"),
        (["--set", "nodeCache.agent.budget=1Pi"], "does not match pattern"),  # the agent's units
        (["--set", "nodeCache.agent.metricsPort=0"], "minimum"),
        (["--set", "nodeCache.agent.interval=0"], "exclusiveMinimum"),
        (["--set", "nodeCache.agent.hostNetwork=true"], "additional properties 'hostNetwork'"),
        (["--set", "nodeCache.enabled=yes"], "want boolean"),
        (["--set", "podMonitor.nodeAgent.interval=often"], "does not match pattern"),
    ],
)
def test_values_schema_refuses_bad_node_cache_values(values: list[str], message: str) -> None:
    result = run([tool("helm"), "template", RELEASE, str(CHART), *ENABLED, *values], check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize(
    "root",
    ["/etc", "/etc/modelstage", "/var/lib/kubelet/node-cache", "/usr/local/cache", "/proc/1",
     "/var", "/var/lib", "/mnt", "/tmp", "/home"],
)  # fmt: skip
def test_a_system_or_shared_directory_is_refused_as_the_root(root: str) -> None:
    """The initContainer hands the root to the agent's user: /etc would be a takeover."""
    result = run(
        [tool("helm"), "template", RELEASE, str(CHART), *ENABLED, "--set", f"nodeCache.root={root}"],
        check=False,
    )
    assert result.returncode != 0
    assert f"nodeCache.root {root} is" in result.stderr, result.stderr


@pytest.mark.parametrize("root", ["/mnt/nvme0/modelstage", "/data/modelstage", "/var/lib/ms"])
def test_a_root_of_its_own_is_accepted(root: str) -> None:
    docs = render_docs(*ENABLED, "--set", f"nodeCache.root={root}")
    (volume,) = [v for v in _agent_pod(docs)["volumes"] if "hostPath" in v]
    assert volume["hostPath"]["path"] == root


def test_helm_lint_passes_strict_with_node_caching() -> None:
    result = run([tool("helm"), "lint", "--strict", str(CHART), *ENABLED,
                  "--set", "podMonitor.nodeAgent.enabled=true"])  # fmt: skip
    assert "0 chart(s) failed" in result.stdout


def test_notes_tell_how_to_check_the_agents_only_when_enabled() -> None:
    def notes(*values: str) -> str:
        text = run([tool("helm"), "install", RELEASE, str(CHART), "--dry-run=client",
                    "-n", RELEASE_NAMESPACE, *values]).stdout  # fmt: skip
        return text.split("NOTES:", 1)[1]

    assert "nodecaches" not in notes()
    text = notes(*ENABLED)
    assert f"rollout status daemonset/{AGENT}" in text
    assert "kubectl get nodecaches" in text
    assert "examples/modeldeployment-node-cache.yaml" in text
    assert "privileged" in text
