"""The node agent the chart runs, against the agent's own code.

The rendered arguments go through the stager CLI's own parser (``modelstage agent``) and its
byte parser, and the agent's API calls are derived from its source (the same derivation as the
operator's in test_chart_rbac.py), so that a renamed flag, a budget the agent cannot read or a
call the chart does not grant fails here, not on a node.
"""

from __future__ import annotations

from typing import Any

import pytest
from chart.test_chart_node_cache import AGENT_RULES, ENABLED, NODE_CACHE_SCENARIOS
from chart.test_chart_rbac import operator_uses
from modelstage.core import node_cache
from modelstage.stager.cli import build_parser, parse_bytes
from support.charts import ROOT, SCENARIOS, one, render, render_docs

AGENT_SOURCE = ROOT / "agent" / "modelstage" / "agent"


def _agent_args(docs: list[dict[str, Any]]) -> list[str]:
    """The agent container's arguments with the downward API variables filled in."""
    (container,) = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    fields = {"spec.nodeName": "gpu-node-1", "status.podIP": "10.1.2.3"}
    values = {
        name: fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for name, e in env.items()
        if "fieldRef" in e.get("valueFrom", {})
    }
    args: list[str] = []
    for arg in container["args"]:
        for name, value in values.items():
            arg = arg.replace(f"$({name})", value)
        assert "$(" not in arg, f"{arg}: a variable the container does not define"
        args.append(arg)
    return args


@pytest.mark.parametrize("scenario", NODE_CACHE_SCENARIOS)
def test_the_agent_cli_reads_the_rendered_arguments(scenario: str) -> None:
    args = build_parser().parse_args(_agent_args(render(scenario)))
    assert args.node == "gpu-node-1"
    assert args.root == node_cache.POD_MOUNT
    assert args.metrics_address == "10.1.2.3", "127.0.0.1 is unreachable for Prometheus"
    assert args.metrics_port > 0
    assert args.interval > 0
    expected = {"node-cache": 500 * 2**30, "node-cache-cluster-wide": 1_500_000_000_000}
    assert parse_bytes(args.budget, "--budget") == expected[scenario]
    assert scenario in SCENARIOS


@pytest.mark.parametrize(
    ("budget", "size"),
    [("1.5Ti", 3 * 2**39), ("800G", 800 * 10**9), ("64Mi", 64 * 2**20), ("1000000", 10**6)],
)
def test_every_budget_the_schema_admits_the_agent_reads(budget: str, size: int) -> None:
    args = build_parser().parse_args(
        _agent_args(render_docs(*ENABLED, "--set-string", f"nodeCache.agent.budget={budget}"))
    )
    assert parse_bytes(args.budget, "--budget") == size


def test_the_agents_role_is_exactly_what_its_code_calls() -> None:
    uses = operator_uses(AGENT_SOURCE)
    assert not uses - AGENT_RULES, f"the agent uses, the chart does not grant: {uses - AGENT_RULES}"
    assert not AGENT_RULES - uses, f"the chart grants, the agent does not use: {AGENT_RULES - uses}"
