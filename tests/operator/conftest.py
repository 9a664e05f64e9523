"""Shared fixtures of the operator's planner tests: the examples, and a spec factory."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from modelstage.api.modeldeployment import ModelDeploymentSpec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CRD_FILE = ROOT / "crds" / "modelstage.io_modeldeployments.yaml"

BASE_SPEC: dict[str, Any] = {
    "model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct", "credentialsSecret": "hf-token"},
    "parallelism": {"tensor": 2},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "models", "path": "/artifacts"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm-llama"}, "containerName": "vllm"},
}


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in; a None value deletes the key (merge-patch style)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


SpecFactory = Callable[..., ModelDeploymentSpec]


@pytest.fixture
def spec_dict() -> Callable[..., dict[str, Any]]:
    def make(**overrides: Any) -> dict[str, Any]:
        return merged(BASE_SPEC, overrides)

    return make


@pytest.fixture
def make_spec(spec_dict: Callable[..., dict[str, Any]]) -> SpecFactory:
    def make(**overrides: Any) -> ModelDeploymentSpec:
        return ModelDeploymentSpec.model_validate(spec_dict(**overrides))

    return make


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture
def deployment() -> dict[str, Any]:
    """The example vLLM Deployment, with the fields the API server adds."""
    workload: dict[str, Any] = load_yaml(EXAMPLES / "vllm-deployment.yaml")
    workload["metadata"].update(namespace="llm", resourceVersion="1001", generation=1)
    return workload


def example_model_deployments() -> list[Path]:
    return sorted(EXAMPLES.glob("modeldeployment-*.yaml"))
