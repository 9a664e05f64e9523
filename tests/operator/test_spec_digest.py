"""``spec + resolved source identity -> digest`` and ``spec -> location``: what changes the
bytes changes the digest, nothing else does, the canonical form is pinned by golden values,
and the artifact lands where the contract says."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from modelstage.api.modeldeployment import ArtifactStatus, ModelDeploymentSpec
from modelstage.core.digest import artifact_digest
from modelstage.core.errors import SpecError
from modelstage.core.layouts import layout_for
from modelstage.operator.artifact import (
    ARTIFACT_MOUNT,
    artifact_for,
    artifact_from_status,
    locate,
    location_from_uri,
    spec_digest,
)

SpecDict = Callable[..., dict[str, Any]]
SpecFactory = Callable[..., ModelDeploymentSpec]
IDENTITY = "commit:" + "ab" * 20


def shuffled(value: Any, rng: random.Random) -> Any:
    """The same document with every mapping's keys in a random order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    return value


def test_digest_is_the_stagers_function_of_the_byte_relevant_fields(make_spec: SpecFactory) -> None:
    spec = make_spec(model={"revision": "main"}, dtype="bfloat16")
    assert spec_digest(spec, IDENTITY) == artifact_digest(
        uri="hf://meta-llama/Meta-Llama-3-8B-Instruct",
        source=IDENTITY,
        tp=2,
        pp=1,
        dtype="bfloat16",
        load_format="sharded_state",
        layout_version=layout_for("0.32").layout_version,
    )


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=0, max_value=2**32))
def test_digest_does_not_depend_on_field_order(seed: int) -> None:
    raw = {
        "model": {"uri": "hf://org/name", "revision": "v1", "credentialsSecret": "tok"},
        "parallelism": {"tensor": 4, "pipeline": 1},
        "dtype": "float16",
        "loadFormat": "tensorizer",
        "storage": {"pvc": {"claimName": "models", "path": "/a"}},
        "serving": {"targetRef": {"name": "vllm", "kind": "Deployment"}, "vllmVersion": "0.32"},
        "stager": {"parallelism": 2, "backoffLimit": 1},
    }
    reordered = shuffled(raw, random.Random(seed))
    assert spec_digest(ModelDeploymentSpec.model_validate(reordered), IDENTITY) == spec_digest(
        ModelDeploymentSpec.model_validate(raw), IDENTITY
    )


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"uri": "hf://meta-llama/Meta-Llama-3-8B"}},
        {"parallelism": {"tensor": 4}},
        {"dtype": "float16"},
        {"loadFormat": "tensorizer"},
    ],
    ids=lambda v: next(iter(v)),
)
def test_every_byte_relevant_change_changes_the_digest(
    make_spec: SpecFactory, change: dict[str, Any]
) -> None:
    assert spec_digest(make_spec(**change), IDENTITY) != spec_digest(make_spec(), IDENTITY)


def test_the_resolved_identity_changes_the_digest_and_the_revision_text_does_not(
    make_spec: SpecFactory,
) -> None:
    """A moved branch is a new artifact; ``main`` and the commit it names are one."""
    spec = make_spec(model={"revision": "main"})
    moved = "commit:" + "cd" * 20
    assert spec_digest(spec, moved) != spec_digest(spec, IDENTITY)
    assert spec_digest(spec, IDENTITY) == spec_digest(
        make_spec(model={"revision": "ab" * 20}), IDENTITY
    )
    files = "sha256:" + "0" * 64
    assert spec_digest(spec, files) not in (spec_digest(spec, IDENTITY), spec_digest(spec, moved))


@pytest.mark.parametrize("source", ["", "main", "sha:4a1b", "commit:ABC", "sha256:" + "0" * 63])
def test_a_digest_is_never_taken_from_an_unresolved_source(source: str) -> None:
    with pytest.raises(ValueError, match="not a resolved source identity"):
        artifact_digest(uri="hf://a/b", source=source, tp=1, pp=1,
                        dtype="auto", load_format="sharded_state", layout_version="x")  # fmt: skip


GOLDEN = [
    # (spec overrides, source identity, digest, canonical JSON the digest is sha256[:20] of).
    # Written down once; a change of the canonical form changes them, and would orphan every
    # stored artifact (artifacts staged before this form are not reused either: docs/api.md).
    ({}, IDENTITY, "2ce8075367dfc2c3697e",
     '{"dtype":"auto","format":"sharded_state","layout":"vllm-0.32/1","pp":1,'
     '"source":"commit:abababababababababababababababababababab","tp":2,'
     '"uri":"hf://meta-llama/Meta-Llama-3-8B-Instruct"}'),
    ({"dtype": "bfloat16", "parallelism": {"tensor": 8}, "model": {"revision": "main"}},
     IDENTITY, "fc9dbad665cb1fee5040",
     '{"dtype":"bfloat16","format":"sharded_state","layout":"vllm-0.32/1","pp":1,'
     '"source":"commit:abababababababababababababababababababab","tp":8,'
     '"uri":"hf://meta-llama/Meta-Llama-3-8B-Instruct"}'),
    ({"model": {"uri": "s3://models/llama-3-8b", "credentialsSecret": None},
      "loadFormat": "runai_streamer_sharded",
      "storage": {"pvc": None, "s3": {"uri": "s3://artifacts/staged"}}},
     "sha256:" + "5e" * 32, "abd32c5fb71cc6051ad6",
     '{"dtype":"auto","format":"runai_streamer_sharded","layout":"vllm-0.32/1","pp":1,'
     '"source":"sha256:' + "5e" * 32 + '","tp":2,"uri":"s3://models/llama-3-8b"}'),
    ({"model": {"uri": "pvc://checkpoints/llama/", "credentialsSecret": None},
      "loadFormat": "tensorizer"}, "sha256:" + "0f" * 32, "563635146a5b0f1f626b",
     '{"dtype":"auto","format":"tensorizer","layout":"vllm-0.32/1","pp":1,'
     '"source":"sha256:' + "0f" * 32 + '","tp":2,"uri":"pvc://checkpoints/llama"}'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "identity", "digest", "canonical"), GOLDEN, ids=["hf", "bf16", "s3", "pvc"]
)
def test_golden_digests_pin_the_canonical_form(
    make_spec: SpecFactory, change: dict[str, Any], identity: str, digest: str, canonical: str
) -> None:
    assert hashlib.sha256(canonical.encode()).hexdigest()[:20] == digest  # the table itself
    assert spec_digest(make_spec(**change), identity) == digest


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"credentialsSecret": "other-token"}},
        {"storage": {"pvc": {"claimName": "elsewhere", "path": "/x"}}},
        {"stager": {"parallelism": 8, "image": "registry.local/stager:dev"}},
        {"serving": {"targetRef": {"name": "other"}, "containerName": "main", "plugin": False}},
        {"serving": {"vllmVersion": "0.32.4"}},
        {"retention": {"keep": 5}},
        {"model": {"uri": "hf://meta-llama/Meta-Llama-3-8B-Instruct/"}},
        {"model": {"revision": "main"}},
        {"model": {"resolveIntervalSeconds": 3600}},
    ],
    ids=lambda v: str(v)[:40],
)
def test_changes_that_keep_the_bytes_keep_the_digest(
    make_spec: SpecFactory, change: dict[str, Any]
) -> None:
    assert spec_digest(make_spec(**change), IDENTITY) == spec_digest(make_spec(), IDENTITY)


def test_unknown_vllm_version_is_a_spec_error_naming_the_supported_ones(
    make_spec: SpecFactory,
) -> None:
    with pytest.raises(SpecError, match=r"supported: 0\.28, .*0\.32$"):
        spec_digest(make_spec(serving={"vllmVersion": "0.1"}), IDENTITY)


@pytest.mark.parametrize(
    ("path", "expected"),
    [("/", "/llm/{d}"), ("/artifacts", "/artifacts/llm/{d}"), ("models/v1/", "/models/v1/llm/{d}")],
)
def test_pvc_location_is_mount_path_namespace_digest(
    make_spec: SpecFactory, path: str, expected: str
) -> None:
    spec = make_spec(storage={"pvc": {"path": path}})
    location = locate(spec, namespace="llm", deployment_name="md", digest="abc123")
    inner = expected.format(d="abc123")
    assert location.path == f"{ARTIFACT_MOUNT}{inner}"
    assert location.uri == f"pvc://models{inner}"
    assert location.claim_name == "models"
    assert location.manifest == f"{ARTIFACT_MOUNT}{inner}/modelstage.json"


def test_s3_location_is_prefix_namespace_digest(make_spec: SpecFactory) -> None:
    spec = make_spec(
        loadFormat="tensorizer", storage={"pvc": None, "s3": {"uri": "s3://bucket/pre/"}}
    )
    location = locate(spec, namespace="llm", deployment_name="md", digest="abc123")
    assert location.uri == location.path == "s3://bucket/pre/llm/abc123"
    assert location.claim_name is None and not location.on_pvc


def test_a_claim_to_create_is_named_after_the_model_deployment(make_spec: SpecFactory) -> None:
    spec = make_spec(storage={"pvc": {"claimName": None, "create": {"size": "10Gi"}}})
    assert (
        locate(spec, namespace="n", deployment_name="llama", digest="d").claim_name
        == "modelstage-llama"
    )


@pytest.mark.parametrize(
    "storage", [{"pvc": {"path": "/a/b"}}, {"pvc": None, "s3": {"uri": "s3://bkt/p"}}]
)
def test_status_uri_leads_back_to_the_same_location(
    make_spec: SpecFactory, storage: dict[str, Any]
) -> None:
    spec = make_spec(loadFormat="tensorizer", storage=storage)
    artifact = artifact_for(spec, namespace="llm", deployment_name="md", identity=IDENTITY)
    assert location_from_uri(artifact.location.uri, artifact.digest) == artifact.location
    status = ArtifactStatus(
        digest=artifact.digest,
        uri=artifact.location.uri,
        format="tensorizer",
        tensor_parallel_size=2,
    )
    assert artifact_from_status(status) == artifact


def test_a_layer_partition_is_in_the_digest_of_a_per_rank_format_only(
    make_spec: SpecFactory,
) -> None:
    """The per-rank files differ with the partition; the Hugging Face layout's do not."""
    even = make_spec(parallelism={"tensor": 2, "pipeline": 2})
    split = make_spec(parallelism={"tensor": 2, "pipeline": 2, "layerPartition": [5, 3]})
    assert spec_digest(split, IDENTITY) == artifact_digest(
        uri="hf://meta-llama/Meta-Llama-3-8B-Instruct", source=IDENTITY, tp=2, pp=2,
        pp_partition=(5, 3), dtype="auto", load_format="sharded_state",
        layout_version=layout_for("0.32").layout_version,
    )  # fmt: skip
    assert spec_digest(split, IDENTITY) != spec_digest(even, IDENTITY)
    layout = {"loadFormat": "safetensors"}
    assert spec_digest(make_spec(**layout, parallelism={"tensor": 2, "pipeline": 2,
                                                        "layerPartition": [5, 3]}), IDENTITY) \
        == spec_digest(make_spec(**layout, parallelism={"tensor": 2, "pipeline": 2}), IDENTITY)  # fmt: skip
    back = artifact_from_status(ArtifactStatus(
        digest="d" * 20, uri="pvc://models/artifacts/llm/" + "d" * 20, format="sharded_state",
        tensor_parallel_size=2, pipeline_parallel_size=2, layer_partition=(5, 3)))  # fmt: skip
    assert back.pp_partition == (5, 3)
