"""The pydantic models: defaults, wire names, and the cross-field rules (CEL's twins)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import kubernetes_validate
import pytest
import yaml
from modelstage.api.modeldeployment import (
    ModelDeployment,
    ModelDeploymentSpec,
    ModelDeploymentStatus,
    SpecLoadFormat,
)
from pydantic import ValidationError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SpecDict = Callable[..., dict[str, Any]]

# (overrides of the base spec, text the refusal must contain): one per cross-field rule.
RULE_VIOLATIONS: list[tuple[dict[str, Any], str]] = [
    ({"storage": {"s3": {"uri": "s3://bucket/p"}}}, "exactly one of storage.pvc and storage.s3"),
    ({"storage": {"pvc": None}}, "exactly one of storage.pvc and storage.s3"),
    ({"loadFormat": "runai_streamer"}, "stream from S3"),
    ({"loadFormat": "runai_streamer_sharded"}, "stream from S3"),
    (
        {"loadFormat": "sharded_state", "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}}},
        "safetensors and sharded_state read local files",
    ),
    (
        {"loadFormat": "safetensors", "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}}},
        "use runai_streamer or runai_streamer_sharded with storage.s3",
    ),
    ({"model": {"uri": "s3://bucket/ckpt", "revision": "main"}}, "revision applies to hf://"),
    ({"model": {"s3": {"endpoint": "http://s3:9000"}}}, "model.s3 applies to s3:// sources"),
    (
        {
            "model": {
                "uri": "s3://bkt/c",
                "credentialsSecret": "a",
                "s3": {"credentialsSecret": "b"},
            }
        },
        "not both",
    ),
    ({"storage": {"pvc": {"claimName": None}}}, "needs claimName"),
    ({"storage": {"pvc": {"path": "models/../../etc"}}}, "must not contain '..'"),
    ({"model": {"uri": "pvc://claim/../../../etc"}}, "model.uri must not contain '..'"),
    ({"model": {"uri": "hf://acme/.."}}, "model.uri must not contain '..'"),
    (
        {
            "storage": {
                "pvc": None,
                "s3": {"uri": "s3://bkt/p", "endpoint": "http://admin:pw@s3:9"},
            },
            "loadFormat": "tensorizer",
        },
        "must not carry credentials",
    ),
    (
        {
            "model": {"uri": "s3://bkt/c", "credentialsSecret": None, "s3": {"region": "x"}},
            "loadFormat": "tensorizer",
            "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}},
        },
        "remove model.s3",
    ),
    (
        {
            "model": {"uri": "s3://bkt/c", "credentialsSecret": "src"},
            "loadFormat": "tensorizer",
            "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}},
        },
        "remove model.credentialsSecret",
    ),
]


@pytest.mark.parametrize(
    "path", sorted(EXAMPLES.glob("modeldeployment-*.yaml")), ids=lambda p: p.stem
)
def test_every_example_parses(path: Path) -> None:
    ModelDeployment.model_validate(yaml.safe_load(path.read_text()))


def test_example_vllm_deployment_is_a_valid_deployment() -> None:
    workload = yaml.safe_load((EXAMPLES / "vllm-deployment.yaml").read_text())
    kubernetes_validate.validate(workload, kubernetes_validate.latest_version(), strict=True)


def test_examples_cover_every_load_format() -> None:
    formats = {
        ModelDeployment.model_validate(yaml.safe_load(p.read_text())).spec.load_format
        for p in EXAMPLES.glob("modeldeployment-*.yaml")
    }
    assert formats == set(get_args(SpecLoadFormat))


def test_minimal_spec_gets_the_documented_defaults() -> None:
    spec = ModelDeploymentSpec.model_validate(
        {
            "model": {"uri": "hf://org/name"},
            "storage": {"pvc": {"claimName": "models"}},
            "serving": {"targetRef": {"name": "vllm"}},
        }
    )
    wire = spec.wire()
    assert wire["parallelism"] == {"tensor": 1, "pipeline": 1}
    assert wire["dtype"] == "auto"
    assert wire["loadFormat"] == "auto"
    assert wire["storage"]["pvc"]["path"] == "/"
    assert wire["serving"] == {
        "targetRef": {"kind": "Deployment", "name": "vllm"},
        "plugin": True,
    }
    assert wire["retention"] == {"keep": 2, "onDelete": "Delete"}
    assert wire["stager"]["backoffLimit"] == 2


def test_wire_form_is_camel_case_and_round_trips(spec_dict: SpecDict) -> None:
    raw = spec_dict(stager={"nodeSelector": {"a": "b"}, "activeDeadlineSeconds": 600})
    spec = ModelDeploymentSpec.model_validate(raw)
    wire = spec.wire()
    assert "loadFormat" in wire and "load_format" not in wire
    assert wire["stager"]["activeDeadlineSeconds"] == 600
    assert ModelDeploymentSpec.model_validate(wire) == spec


def test_snake_case_names_are_accepted_in_python(spec_dict: SpecDict) -> None:
    raw = spec_dict()
    raw["load_format"] = raw.pop("loadFormat")
    assert ModelDeploymentSpec.model_validate(raw).load_format == "sharded_state"


@pytest.mark.parametrize(("overrides", "message"), RULE_VIOLATIONS, ids=lambda v: str(v)[:40])
def test_cross_field_rules_refuse_with_an_actionable_message(
    spec_dict: SpecDict, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        ModelDeploymentSpec.model_validate(spec_dict(**overrides))


def test_a_credential_in_an_s3_endpoint_is_refused_without_being_repeated(
    spec_dict: SpecDict,
) -> None:
    from modelstage.operator.observe import _first_error

    body = spec_dict(model={"uri": "s3://bkt/c", "s3": {"endpoint": "http://admin:hunter2@s3:9"}})
    with pytest.raises(ValidationError) as refused:
        ModelDeploymentSpec.model_validate(body)
    message = _first_error(refused.value)  # what the operator writes into the status
    assert "must not carry credentials" in message and "hunter2" not in message


@pytest.mark.parametrize(
    "overrides",
    [
        {"parallelism": {"tensorParallel": 2}},
        {"parallelism": {"pipeline": 0}},
        {"parallelism": {"tensor": 0}},
        {"dtype": "int8"},
        {"loadFormat": "pytorch"},
        {"model": {"uri": "https://huggingface.co/org/name"}},
        {"storage": {"pvc": {"claimName": "Models_With_Caps"}}},
        {"serving": {"targetRef": {"kind": "DaemonSet"}}},
        {"serving": {"vllmVersion": "latest"}},
        {"retention": {"keep": 0}},
    ],
    ids=lambda v: str(v)[:50],
)
def test_schema_level_mistakes_are_refused(spec_dict: SpecDict, overrides: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ModelDeploymentSpec.model_validate(spec_dict(**overrides))


def test_tensorizer_is_allowed_on_both_storage_kinds(spec_dict: SpecDict) -> None:
    on_pvc = spec_dict(loadFormat="tensorizer")
    on_s3 = spec_dict(loadFormat="tensorizer", storage={"pvc": None, "s3": {"uri": "s3://bkt/p"}})
    for raw in (on_pvc, on_s3):
        assert ModelDeploymentSpec.model_validate(raw).load_format == "tensorizer"


def test_status_keeps_working_with_fields_it_does_not_know() -> None:
    status = ModelDeploymentStatus.model_validate(
        {"phase": "Staging", "kopf": {"progress": {}}, "create_fn": {"x": 1}}
    )
    assert status.phase == "Staging"
