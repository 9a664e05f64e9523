"""``what each ModelDeployment pins and warms -> a node's NodeCache spec``.

The operator tells each node's agent what to keep and what to warm (the agent reads its own
``NodeCache`` and lists no ModelDeployment): ``keep`` is every (namespace, digest) some
ModelDeployment with node caching pins (``retention.pinned_digests``: the one place the rule
lives), the same on every node; ``warm`` the pairs of the ModelDeployments in phase Warming
that list the node. Pure; the handlers write it by merge patch when it differs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from modelstage.api.nodecache import Grant, NodeCacheSpec
from modelstage.core import node_cache as nc


@dataclass(frozen=True)
class CacheUse:
    """One ModelDeployment with node caching on, as the node specs see it."""

    namespace: str
    pins: frozenset[str]
    """Digests whose copies it pins."""
    warming: str | None = None
    """The digest it asks its nodes to warm now (phase Warming), if any."""
    nodes: frozenset[str] = frozenset()
    """The nodes its ``status.nodeCache`` lists."""


def plan_node_spec(node: str, uses: Iterable[CacheUse]) -> NodeCacheSpec:
    """The spec of ``node``'s NodeCache, sorted so that an unchanged one compares equal."""
    keep: set[tuple[str, str]] = set()
    warm: set[tuple[str, str]] = set()
    for use in uses:
        keep |= {(use.namespace, d) for d in use.pins}
        if use.warming is not None and node in use.nodes:
            warm.add((use.namespace, use.warming))
    return NodeCacheSpec(
        keep=[Grant(namespace=n, digest=d) for n, d in sorted(keep)],
        warm=[Grant(namespace=n, digest=d) for n, d in sorted(warm)],
    )


def spec_patch(current: object, wanted: NodeCacheSpec) -> dict[str, object] | None:
    """The merge patch that makes a NodeCache's ``spec`` (as read) ``wanted``; None when it
    already is."""
    body = wanted.wire()
    body = {"keep": body.get("keep", []), "warm": body.get("warm", [])}
    if current == body:
        return None
    return {"apiVersion": nc.API_VERSION, "kind": nc.KIND, "spec": body}
