"""Shared fixtures of the operator's planner tests: the examples, and a spec factory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from modelstage.api.modeldeployment import ModelDeploymentSpec
from support.model_specs import BASE_SPEC, merged

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CRD_FILE = ROOT / "crds" / "modelstage.io_modeldeployments.yaml"

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
