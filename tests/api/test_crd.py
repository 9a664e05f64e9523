"""The generated CRD: fresh, structural, accepted by Kubernetes' CRD schema, and enforcing what
the models enforce (JSON schema for the per-field checks, CEL for the cross-field rules)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml
from modelstage.api import crd
from modelstage.api.modeldeployment import ModelDeploymentSpec
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "modelstage.io_modeldeployments.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("modeldeployment-*.yaml"))
SpecDict = Callable[..., dict[str, Any]]
# CEL validation rules are GA since Kubernetes 1.29: every version from there is a target.
KUBERNETES_VERSIONS = ["1.29.0", "1.31.0", "1.33.0", kubernetes_validate.latest_version()]


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CRD_FILE.read_text())
    return loaded


@pytest.fixture(scope="module")
def schema(document: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = document["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return result


def nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, prop in (schema.get("properties") or {}).items():
        yield from nodes(prop, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from nodes(schema[key], f"{path}[{key}]")


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """What the API server does before validating: fill defaults of absent fields, recursively."""
    if isinstance(obj, dict) and "properties" in schema:
        for name, prop in schema["properties"].items():
            if name not in obj and "default" in prop:
                obj[name] = copy.deepcopy(prop["default"])
            if name in obj:
                obj[name] = apply_defaults(prop, obj[name])
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


def cel_failures(schema: dict[str, Any], obj: Any) -> list[str]:
    """Messages of the x-kubernetes-validations rules that ``obj`` breaks (evaluated by celpy)."""
    failures: list[str] = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(obj)}):
            failures.append(rule["message"])
    if isinstance(obj, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name in obj:
                failures += cel_failures(prop, obj[name])
    return failures


def test_committed_crd_is_what_the_models_generate() -> None:
    assert CRD_FILE.read_text() == crd.render(), (
        "crds/ is stale: run `python -m modelstage.api.crd > "
        + str(CRD_FILE.relative_to(ROOT))
        + "`"
    )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_crd_document_passes_kubernetes_validate(document: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(document, version, strict=True)


def test_crd_yaml_has_no_anchors_or_aliases() -> None:
    text = CRD_FILE.read_text()
    assert "&id" not in text and "*id" not in text


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    for path, node in nodes(schema):
        assert "$ref" not in node, path
        assert "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "anyOf" not in node and "oneOf" not in node, path
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, (
            path
        )
        assert not ("properties" in node and "additionalProperties" in node), path


def test_every_default_is_valid_for_its_field(schema: dict[str, Any]) -> None:
    for _, node in nodes(schema):
        if "default" in node:
            jsonschema.Draft7Validator(node).validate(
                apply_defaults(node, copy.deepcopy(node["default"]))
            )


def test_status_subresource_printer_columns_and_short_names(
    document: dict[str, Any], schema: dict[str, Any]
) -> None:
    version = document["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert document["spec"]["scope"] == "Namespaced"
    assert {"md", "mdep"} <= set(document["spec"]["names"]["shortNames"])
    printed = version["additionalPrinterColumns"]
    columns = {c["name"]: c["jsonPath"] for c in printed}
    assert [c["name"] for c in printed if not c.get("priority")] == [
        "Phase", "Ready", "Reason", "Model", "TP", "Age"
    ]  # fmt: skip
    assert [c["name"] for c in printed if c.get("priority") == 1] == [
        "Target", "Format", "Digest", "Source"
    ]  # fmt: skip
    for json_path in columns.values():
        node: dict[str, Any] = schema
        path = json_path.replace('[?(@.type=="Ready")]', ".items")  # the filter selects items
        for part in path.strip(".").split("."):
            if part == "items":
                node = node["items"]
            elif part != "creationTimestamp":
                node = node["properties"][part]
        if not json_path.startswith(".metadata"):
            assert node.get("type") in ("string", "integer"), json_path


def test_status_keeps_kopf_fields_and_conditions_are_a_map(schema: dict[str, Any]) -> None:
    status = schema["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_validates_against_the_crd(schema: dict[str, Any], path: Path) -> None:
    obj = apply_defaults(schema, yaml.safe_load(path.read_text()))
    jsonschema.Draft7Validator(schema).validate(obj)
    assert cel_failures(schema, obj) == []


# Refused by the structural schema (JSON schema), each one a mistake people make.
SCHEMA_REJECTS: list[dict[str, Any]] = [
    {"parallelism": {"tensor": 0}},
    {"parallelism": {"tensor": 65}},
    {"parallelism": {"pipeline": 0}},
    {"parallelism": {"pipeline": 65}},
    {"dtype": "fp8"},
    {"loadFormat": "pytorch"},
    {"model": {"uri": "meta-llama/Meta-Llama-3-8B"}},
    {"model": {"uri": "gs://bucket/model"}},
    {"model": {"credentialsSecret": "Not_A_Name"}},
    {"storage": {"s3": {"uri": "s3://B/x"}}},
    {"storage": {"pvc": {"create": {"size": "10Gi", "accessModes": ["ReadWriteSometimes"]}}}},
    {"stager": {"backoffLimit": -1}},
    {"stager": {"activeDeadlineSeconds": 5}},
    {"stager": {"tolerations": [{"operator": "Maybe"}]}},
    {"serving": {"targetRef": {"kind": "DaemonSet"}}},
    {"serving": {"vllmVersion": "v0.32"}},
    {"serving": {"plugin": "yes"}},
    {"retention": {"keep": 11}},
    {"serving": None},
    {"model": None},
]


@pytest.mark.parametrize("overrides", SCHEMA_REJECTS, ids=lambda v: str(v)[:50])
def test_schema_rejects_bad_specs_and_so_do_the_models(
    schema: dict[str, Any], spec_dict: SpecDict, overrides: dict[str, Any]
) -> None:
    obj = {
        "apiVersion": "modelstage.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "x"},
    }
    obj["spec"] = spec_dict(**overrides)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(apply_defaults(schema, obj))
    with pytest.raises(ValidationError):
        ModelDeploymentSpec.model_validate(obj["spec"])


# Cross-field cases: CEL (as the API server runs it) and the models must agree on every one.
CROSS_FIELD_CASES: list[dict[str, Any]] = [
    {},
    {"serving": {"targetRef": {"kind": "LeaderWorkerSet", "name": "vllm"}}},
    {
        "serving": {"targetRef": {"kind": "LeaderWorkerSet", "name": "v"}},
        "nodeCache": {"enabled": True},
    },
    {
        "serving": {"targetRef": {"kind": "LeaderWorkerSet", "name": "v"}},
        "engineCache": {"enabled": True},
    },
    {
        "serving": {"targetRef": {"kind": "LeaderWorkerSet", "name": "v"}},
        "nodeCache": {"enabled": False},
    },
    {
        "serving": {"targetRef": {"kind": "StatefulSet", "name": "v"}},
        "nodeCache": {"enabled": True},
    },
    {"storage": {"s3": {"uri": "s3://bucket/p"}}},
    {"storage": {"pvc": None}},
    {"loadFormat": "runai_streamer"},
    {"loadFormat": "runai_streamer", "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}}},
    {"loadFormat": "runai_streamer_sharded", "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}}},
    {"loadFormat": "sharded_state", "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}}},
    {"loadFormat": "tensorizer", "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}}},
    {"loadFormat": "tensorizer"},
    {"model": {"uri": "s3://bucket/ckpt", "revision": "main"}},
    {"model": {"revision": "4a1b2c"}},
    {"model": {"s3": {"endpoint": "http://s3:9000"}}},
    {"model": {"uri": "s3://bkt/c", "s3": {"endpoint": "http://s3:9000"}}},
    {"model": {"uri": "s3://bkt/c", "credentialsSecret": "a", "s3": {"credentialsSecret": "b"}}},
    {"storage": {"pvc": {"claimName": None}}},
    {"storage": {"pvc": {"claimName": None, "create": {"size": "100Gi"}}}},
    {"storage": {"pvc": {"claimName": None, "create": {}}}},
    {"storage": {"pvc": {"claimName": None, "create": {}}}, "model": {"sizeHint": "70Gi"}},
    {"storage": {"pvc": {"path": "models/../etc"}}},
    {"storage": {"pvc": {"path": "models/..hidden/x"}}},
    {"model": {"resolveIntervalSeconds": 0}},
    {"model": {"resolveIntervalSeconds": 59}},
    {"model": {"resolveIntervalSeconds": 60}},
    {"model": {"uri": "pvc://claim/../../../etc"}},
    {"model": {"uri": "pvc://claim/ckpt/.."}},
    {"model": {"uri": "pvc://claim/ckpt..v2/x"}},
    {"model": {"uri": "hf://acme/.."}},
    {"model": {"uri": "s3://bkt/a/../b", "revision": None}},
    {
        "storage": {
            "s3": {"uri": "s3://bkt/p", "endpoint": "http://admin:secret@s3:9000"},
            "pvc": None,
        },
        "loadFormat": "tensorizer",
    },
    {"model": {"uri": "s3://bkt/c", "revision": None, "s3": {"endpoint": "https://key@s3.local"}}},
    {
        "storage": {"s3": {"uri": "s3://bkt/p", "endpoint": "http://s3:9000/path"}, "pvc": None},
        "loadFormat": "tensorizer",
    },
    {
        "model": {"uri": "s3://bkt/c", "credentialsSecret": None, "s3": {"region": "x"}},
        "loadFormat": "tensorizer",
        "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}},
    },
    {"parallelism": {"tensor": 2, "pipeline": 2, "layerPartition": [3, 5]}},
    {"parallelism": {"tensor": 2, "pipeline": 2, "layerPartition": [4, 2, 2]}},
    {"parallelism": {"tensor": 2, "pipeline": 3, "layerPartition": [3, 5]}},
    {"parallelism": {"tensor": 2, "layerPartition": [4, 4]}},
    {
        "model": {"uri": "s3://bkt/c", "credentialsSecret": "src"},
        "loadFormat": "tensorizer",
        "storage": {"pvc": None, "s3": {"uri": "s3://bkt/p"}},
    },
]


@pytest.mark.parametrize("overrides", CROSS_FIELD_CASES, ids=lambda v: str(v)[:60])
def test_cel_rules_and_model_validators_agree(
    schema: dict[str, Any], spec_dict: SpecDict, overrides: dict[str, Any]
) -> None:
    raw = spec_dict(**overrides)
    spec_schema = schema["properties"]["spec"]
    jsonschema.Draft7Validator(spec_schema).validate(raw)  # only cross-field rules differ here
    cel = cel_failures(spec_schema, apply_defaults(spec_schema, copy.deepcopy(raw)))
    try:
        ModelDeploymentSpec.model_validate(raw)
        pydantic_errors: list[str] = []
    except ValidationError as error:
        pydantic_errors = [e["msg"].removeprefix("Value error, ") for e in error.errors()]
    # The API server reports every broken rule; pydantic stops at the innermost model that
    # fails. They must agree on the verdict, and pydantic's reason must be one of CEL's.
    assert bool(cel) == bool(pydantic_errors)
    assert set(pydantic_errors) <= set(cel)


def test_cross_field_cases_exercise_every_rule(schema: dict[str, Any], spec_dict: SpecDict) -> None:
    spec_schema = schema["properties"]["spec"]
    broken = {
        message
        for overrides in CROSS_FIELD_CASES
        for message in cel_failures(
            spec_schema, apply_defaults(spec_schema, spec_dict(**overrides))
        )
    }
    every_rule = {
        rule["message"]
        for _, node in nodes(spec_schema)
        for rule in node.get("x-kubernetes-validations", [])
    }
    assert broken == every_rule
