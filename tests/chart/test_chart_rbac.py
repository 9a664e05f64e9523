"""The chart's RBAC grants exactly what the operator uses: no wildcard, nothing more, nothing less.

The operator has no permission table of its own, so this test derives the (group, resource,
verb) set from the operator's source with ``ast``:

- kopf handler registrations (``kopf.on.*``, ``kopf.timer``, ``kopf.index``, ...) watch their
  resource: ``list`` + ``watch``; change handlers (create/update/resume/delete/timer/daemon) on a
  resource also make kopf ``patch`` it (progress and diff-base annotations, finalizers);
- calls of the handlers' client (``self.kube.get/list/create/merge_patch(path)``) whose path
  is built by ``resource_path(api_version, plural, ..., subresource)`` or by the helpers that
  wrap it (``md_path``, ``workload_path``), resolved through local assignments;
- ``kopf.event(...)`` posts core Events: ``create``.

kopf's framework needs that no operator line shows are listed in ``FRAMEWORK`` with the reason.
A new API call in the operator without a matching chart rule (or a chart rule that nothing
uses) fails here; the justification of each rule is in ``templates/rbac.yaml``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from modelstage.api import modeldeployment as operator_api
from modelstage.api.objects import Owner
from modelstage.core import node_cache
from modelstage.operator.workload_kinds import KINDS
from support.charts import ROOT, SCENARIOS, is_namespaced, of_kind, render

Triple = tuple[str, str, str]
"""(API group, resource[/subresource], verb)."""

OPERATOR = ROOT / "operator" / "modelstage" / "operator"
CLIENT_VERBS = {
    "get": "get",
    "text": "get",
    "list": "list",
    "create": "create",
    "merge_patch": "patch",
    "delete": "delete",
    "watch": "watch",
}
WATCH_DECORATORS = {"event", "index", "create", "update", "resume", "delete", "field", "timer", "daemon"}  # fmt: skip
CHANGE_HANDLERS = {"create", "update", "resume", "delete", "field", "timer", "daemon"}
"""kopf stores progress and the diff base in annotations of the object: it patches it."""
NODE_CACHE = "nodeCache.enabled=true"
OPT_IN: dict[Triple, str] = {
    ("", "pods/log", "get"): "operator.stagerProgressFromLogs=true",
    **{("", "nodes", verb): NODE_CACHE for verb in ("get", "list", "watch")},
    **{
        (node_cache.API_GROUP, node_cache.PLURAL, v): NODE_CACHE
        for v in ("get", "list", "watch", "patch")
    },
    **{("", "persistentvolumes", v): NODE_CACHE for v in ("create", "list", "watch", "delete")},
}
"""Calls the operator makes only when a chart value turns them on, which also grants them
(node caching: ModelDeployments with spec.nodeCache need the Nodes, the agents' reports, each
node's NodeCache spec and the copies' PersistentVolumes)."""
CONSTANTS = {
    "GROUP": operator_api.GROUP,
    "VERSION": operator_api.VERSION,
    "PLURAL": operator_api.PLURAL,
    "API_VERSION": operator_api.API_VERSION,
}


def framework(namespaced: bool, peering: bool) -> set[Triple]:
    """What kopf itself (not an operator line) needs in each mode."""
    needs: set[Triple] = {("", "events", "create")}  # kopf posts handler outcomes as Events
    if not namespaced:
        # kopf's resource observer watches CRDs to notice ours appearing or changing.
        needs |= {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}  # fmt: skip
    if peering:
        plural = "kopfpeerings" if namespaced else "clusterkopfpeerings"
        needs |= {("kopf.dev", plural, v) for v in ("list", "watch", "patch")}
    if Owner("x", "ns", "uid").reference().get("blockOwnerDeletion"):
        # OwnerReferencesPermissionEnforcement: blockOwnerDeletion needs update on the
        # owner's finalizers subresource.
        needs.add((operator_api.GROUP, f"{operator_api.PLURAL}/finalizers", "update"))
    return needs


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0] if "/" in api_version else ""


def _value(node: ast.expr, scope: dict[str, ast.expr]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        base = scope.get(node.value.id, node.value)
        if isinstance(base, ast.Name) and base.id == "node_cache":
            return getattr(node_cache, node.attr, None)  # the names core.node_cache shares
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        if node.id in scope:
            return _value(scope[node.id], scope)
    return None


def _call_name(node: ast.Call) -> str:
    return ast.unparse(node.func)


def _paths(
    node: ast.expr, scope: dict[str, ast.expr], module: dict[str, Any]
) -> Iterator[tuple[str, str]]:
    """(group, resource) of a path expression."""
    if isinstance(node, ast.Name) and node.id in scope:
        yield from _paths(scope[node.id], scope, module)
        return
    if (
        isinstance(node, ast.JoinedStr)
        and len(node.values) == 2
        and isinstance(node.values[0], ast.FormattedValue)
        and isinstance(node.values[1], ast.Constant)
        and str(node.values[1].value).startswith("/")
    ):  # f"{path}/status": a subresource of a resolved path
        for group, resource in _paths(node.values[0].value, scope, module):
            yield group, resource + str(node.values[1].value)
        return
    if not isinstance(node, ast.Call):
        raise AssertionError(f"cannot resolve the API path {ast.unparse(node)}")
    name = _call_name(node)
    args = [_value(a, scope) for a in node.args]
    kwargs = {k.arg: _value(k.value, scope) for k in node.keywords}
    if name == "resource_path":
        sub = kwargs.get("subresource", args[4] if len(args) > 4 else None)
        yield _group(args[0]), args[1] + (f"/{sub}" if sub else "")
    elif name == "md_path":
        sub = kwargs.get("subresource", args[2] if len(args) > 2 else None)
        yield operator_api.GROUP, operator_api.PLURAL + (f"/{sub}" if sub else "")
    elif name == "workload_path":
        for kind in KINDS.values():
            yield kind.group, kind.plural
    else:
        raise AssertionError(f"unknown API path helper {name}()")


def _kopf_resource(args: list[Any]) -> tuple[str, str]:
    """kopf's (group, version, plural) / (group_or_version, plural) / ("plural.group")."""
    if len(args) == 3:
        return ("" if args[0] == "v1" else args[0]), args[2]
    if len(args) == 2:
        return ("" if args[0] == "v1" else args[0].rpartition("/")[0]), args[1]
    plural, _, group = args[0].partition(".")
    return group, plural


def _outside_functions(tree: ast.AST) -> list[ast.AST]:
    """The nodes of a module that no function contains (each function is its own scope: a
    ``path`` assigned in one must not resolve a ``path`` used in another)."""
    found: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        found.append(node)
        stack += [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.FunctionDef)]
    return found


def operator_uses(folder: Path = OPERATOR) -> set[Triple]:
    """What the modules in ``folder`` (default: the operator's) do through the API."""
    uses: set[Triple] = set()
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, ast.expr] = {  # `from modelstage.core import node_cache as nc`
            alias.asname: ast.Name(id="node_cache")
            for stmt in tree.body
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "modelstage.core"
            for alias in stmt.names
            if alias.name == "node_cache" and alias.asname
        }
        module: dict[str, Any] = {}
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
                try:
                    module[stmt.targets[0].id] = ast.literal_eval(stmt.value)
                except ValueError:
                    module[stmt.targets[0].id] = stmt.value
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        for nodes in [list(ast.walk(f)) for f in functions] + [_outside_functions(tree)]:
            scope: dict[str, ast.expr] = {
                n.targets[0].id: n.value
                for n in nodes
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            }
            scope.update({k: v for k, v in module.items() if isinstance(v, ast.expr)})
            scope.update(aliases)
            for node in nodes:
                if not isinstance(node, ast.Call):
                    continue
                name = _call_name(node)
                parts = name.split(".")
                if name in ("kopf.event", "kopf.info", "kopf.warn", "kopf.exception"):
                    uses.add(("", "events", "create"))
                elif parts[:1] == ["kopf"] and parts[-1] in WATCH_DECORATORS and len(parts) <= 3:
                    args: list[Any] = []
                    for arg in node.args:
                        if isinstance(arg, ast.Starred):
                            args += [_value(e, scope) for e in module[arg.value.id].elts]
                        else:
                            args.append(_value(arg, scope))
                    group, plural = _kopf_resource(args)
                    verbs = {"list", "watch"} | (
                        {"patch"} if parts[-1] in CHANGE_HANDLERS else set()
                    )
                    uses |= {(group, plural, v) for v in verbs}
                elif (
                    name.startswith(("self.kube.", "kube.", "reconciler.kube."))
                    and parts[-1] in CLIENT_VERBS
                ):
                    for group, resource in _paths(node.args[0], scope, module):
                        uses.add((group, resource, CLIENT_VERBS[parts[-1]]))
    return uses


def bound_to(docs: list[dict[str, Any]], account: str) -> list[dict[str, Any]]:
    """The Roles and ClusterRoles that bindings give the ServiceAccount ``account``."""
    refs = {
        (b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace"))
        for b in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding")
        if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"])
    }
    return [
        r
        for r in of_kind(docs, "ClusterRole") + of_kind(docs, "Role")
        if (r["kind"], r["metadata"]["name"], r["metadata"].get("namespace")) in refs
    ]


def operator_account(docs: list[dict[str, Any]]) -> str:
    name: str = of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["serviceAccountName"]
    return name


def granted(
    docs: list[dict[str, Any]], roles: list[dict[str, Any]] | None = None
) -> tuple[set[Triple], list[str]]:
    """(group, resource, verb) of ``roles`` (default: every role rendered), and wildcards."""
    triples: set[Triple] = set()
    wildcards: list[str] = []
    for role in of_kind(docs, "ClusterRole") + of_kind(docs, "Role") if roles is None else roles:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                if any("*" in item for item in rule.get(key, [])):
                    wildcards.append(f"{role['kind']} {key}: {rule[key]}")
            assert "nonResourceURLs" not in rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        triples.add((group, resource, verb))
    return triples, wildcards


def test_the_derivation_sees_the_operators_calls() -> None:
    """Guards the parser itself: calls known to exist in reconcile.py and handlers.py."""
    uses = operator_uses()
    assert ("batch", "jobs", "create") in uses
    assert ("modelstage.io", "modeldeployments/status", "patch") in uses
    assert ("apps", "statefulsets", "patch") in uses
    assert ("", "pods", "watch") in uses
    assert ("modelstage.io", "nodecaches", "patch") in uses  # handlers' reconciler.kube
    assert ("", "persistentvolumes", "delete") in uses


def test_rbac_has_no_wildcard_and_is_exactly_what_the_operator_uses(scenario: str) -> None:
    docs = render(scenario)
    assert not granted(docs)[1]
    triples, wildcards = granted(docs, bound_to(docs, operator_account(docs)))
    assert not wildcards
    namespaced = is_namespaced(scenario)
    expected = operator_uses() | framework(namespaced, "no-peering" not in scenario)
    args = " ".join(SCENARIOS[scenario])
    expected -= {triple for triple, value in OPT_IN.items() if value not in args}
    missing, extra = expected - triples, triples - expected
    assert not missing, (
        f"{scenario}: the operator uses, the chart does not grant: {sorted(missing)}"
    )
    assert not extra, f"{scenario}: the chart grants, nothing uses: {sorted(extra)}"


def test_roles_bind_only_the_operators_service_account(scenario: str) -> None:
    """The node agent's own role and binding are checked in test_chart_node_cache.py."""
    docs = [
        d
        for d in render(scenario)
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") != "node-agent"
    ]
    (account,) = of_kind(docs, "ServiceAccount")
    roles = {
        (r["kind"], r["metadata"]["name"])
        for r in of_kind(docs, "ClusterRole") + of_kind(docs, "Role")
    }
    bindings = of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding")
    assert bindings
    for binding in bindings:
        ref = binding["roleRef"]
        assert (ref["kind"], ref["name"]) in roles, "bound to a role the chart does not define"
        assert ref["name"] not in ("cluster-admin", "admin", "edit")
        assert binding["subjects"] == [
            {
                "kind": "ServiceAccount",
                "name": account["metadata"]["name"],
                "namespace": account["metadata"]["namespace"],
            }
        ]
    pod = of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_rbac_rules_are_commented_in_the_template() -> None:
    """Every rule in the RBAC templates has a comment line right above it."""
    for name in ("rbac.yaml", "node-cache-rbac.yaml"):
        lines = (ROOT / "charts" / "modelstage" / "templates" / name).read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("- apiGroups:"):
                assert lines[i - 1].strip().startswith("#"), (
                    f"{name}:{i + 1}: rule without a reason"
                )


def test_no_permission_on_secrets_anywhere(scenario: str) -> None:
    triples, _ = granted(render(scenario))
    assert not [t for t in triples if t[1] in ("secrets", "pods/exec")]
    logs = [t for t in triples if t[1] == "pods/log"]
    assert logs == ([("", "pods/log", "get")] if "stagerProgressFromLogs=true" in " ".join(
        SCENARIOS[scenario]) else [])  # fmt: skip
