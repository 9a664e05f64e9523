"""Helpers of the chart and packaging checks (tests/chart): the real tools, rendered manifests.

``helm`` and ``kubectl`` are the static binaries that ``scripts/tools`` installs (``scripts/setup``
runs it); hadolint, yamllint, shellcheck and kubernetes-validate come from the ``dev`` extra. A
missing tool is a failure with the command that installs it, not a skip: these checks are what
``.ci/run`` promises. Every subprocess runs with a working directory outside the checkout, so
that nothing a tool writes lands in it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "modelstage"
TOOLS_BIN = (
    Path(os.environ.get("MODELSTAGE_TOOLS", Path.home() / ".cache" / "modelstage" / "tools"))
    / "bin"
)
VENV_BIN = Path(sys.executable).parent
RELEASE = "ms"
RELEASE_NAMESPACE = "modelstage-system"

SCENARIOS: dict[str, list[str]] = {
    "default": [],
    "cluster-wide": ["--set", "watch.namespaced=false"],
    "namespaced": [
        "--set", "watch.namespaced=true",
        "--set", "watch.namespaces={team-a,team-b}",
    ],
    "namespaced-release-namespace": ["--set", "watch.namespaced=true"],
    "monitoring": [
        "--set", "serviceMonitor.enabled=true",
        "--set", "podMonitor.vllmLoader.enabled=true",
        "--set", "podMonitor.vllmLoader.maxRanks=4",
        "--set", "podMonitor.vllmLoader.namespaces={serving}",
    ],
    "namespaced-monitoring-no-peering": [
        "--set", "watch.namespaced=true",
        "--set", "peering.enabled=false",
        "--set", "serviceMonitor.enabled=true",
        "--set", "podMonitor.vllmLoader.enabled=true",
        "--set", "grafanaDashboard.enabled=false",
    ],
    "stager-progress-from-logs": [
        "--set", "operator.stagerProgressFromLogs=true",
        "--set", "operator.resolveInterval=3600",
    ],
    "node-cache": [
        "--set", "nodeCache.enabled=true",
        "--set", "podMonitor.nodeAgent.enabled=true",
    ],
    "node-cache-cluster-wide": [
        "--set", "watch.namespaced=false",
        "--set", "nodeCache.enabled=true",
        "--set", "nodeCache.root=/mnt/nvme0/modelstage",
        "--set", "nodeCache.agent.budget=1500000000000",
        "--set-string", "nodeCache.agent.nodeSelector.nvidia\\.com/gpu\\.present=true",
        "--set", "nodeCache.agent.tolerations[0].key=nvidia.com/gpu",
        "--set", "nodeCache.agent.tolerations[0].operator=Exists",
        "--set", "nodeCache.agent.tolerations[0].effect=NoSchedule",
        "--set", "nodeCache.agent.priorityClassName=system-node-critical",
        "--set", "serviceMonitor.enabled=true",
        "--set", "podMonitor.nodeAgent.enabled=true",
    ],
}  # fmt: skip
"""``helm template`` value sets every rendering check runs over."""


def is_namespaced(scenario: str) -> bool:
    """Whether a scenario renders namespaced mode (the chart's default)."""
    return "watch.namespaced=false" not in SCENARIOS[scenario]


def tool(name: str) -> str:
    """Path of a tool: helm/kubectl from scripts/tools, the rest from the venv or PATH."""
    for folder in (TOOLS_BIN, VENV_BIN):
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        hint = "scripts/tools" if name in ("helm", "kubectl") else "scripts/setup (dev extra)"
        pytest.fail(f"{name} is not installed: run {hint}")
    return found


def run(
    args: Sequence[str], *, check: bool = True, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Runs a tool outside the checkout; on failure the message carries its output."""
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/modelstage-helm-cache"}
    result = subprocess.run(
        list(args), cwd="/", env=env, capture_output=True, text=True, timeout=300, **kwargs
    )
    if check and result.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


@cache
def render_values(*args: str) -> str:
    """``helm template`` of the chart with these ``--set`` style arguments."""
    return run(
        [tool("helm"), "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, *args]
    ).stdout


def render_text(scenario: str) -> str:
    return render_values(*SCENARIOS[scenario])


def render(scenario: str) -> list[dict[str, Any]]:
    """The documents ``helm template`` renders for a scenario (empty documents dropped)."""
    return [doc for doc in yaml.safe_load_all(render_text(scenario)) if doc]


def render_docs(*args: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_values(*args)) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]
