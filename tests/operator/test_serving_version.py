"""The vLLM version an artifact is staged for: the spec's, else the vLLM image's tag, else the
default (said in the reason); a version without a layout is refused whichever way it came; the
digest follows the layout, not the release."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from modelstage.api.modeldeployment import ModelDeploymentSpec, SourceStatus, VllmVersionStatus
from modelstage.api.objects import Owner
from modelstage.core import layouts
from modelstage.core.errors import SpecError
from modelstage.operator.artifact import artifact_at, spec_digest
from modelstage.operator.job_plan import plan_stage_job
from modelstage.operator.resolve_plan import chosen_format, source_key
from modelstage.operator.serving_version import (
    FROM_SPEC,
    image_tag,
    image_vllm_version,
    recorded_version,
    serving_version,
    with_version,
)
from modelstage.operator.validation import validate_workload

SpecFactory = Callable[..., ModelDeploymentSpec]

NAME, NAMESPACE = "llama-70b", "llm"
IDENTITY = "commit:" + "ab" * 20


def _with_image(deployment: dict[str, Any], image: str) -> dict[str, Any]:
    workload = copy.deepcopy(deployment)
    (vllm,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    vllm["image"] = image
    return workload


def _served(spec: ModelDeploymentSpec, workload: dict[str, Any] | None) -> tuple[str, str]:
    chosen = serving_version(spec, workload, namespace=NAMESPACE, deployment_name=NAME)
    return chosen.version, chosen.reason


@pytest.mark.parametrize(
    ("image", "tag", "version"),
    [
        ("vllm/vllm-openai:v0.30.1", "v0.30.1", "0.30"),
        ("vllm/vllm-openai:v0.28.0", "v0.28.0", "0.28"),
        ("docker.io/vllm/vllm-openai:0.31", "0.31", "0.31"),
        ("registry.local:5000/team/vllm:v0.32.0-cpu", "v0.32.0-cpu", "0.32"),
        ("vllm/vllm-openai:v0.10.1.1", "v0.10.1.1", "0.10"),
        ("vllm/vllm-openai:v0.30.1@sha256:" + "0" * 64, "v0.30.1", "0.30"),
        ("vllm/vllm-openai@sha256:" + "0" * 64, None, None),
        ("registry.local:5000/vllm", None, None),
        ("vllm/vllm-openai:latest", "latest", None),
        ("vllm/vllm-openai:nightly-0a1b2c", "nightly-0a1b2c", None),
        ("vllm/vllm-openai:v0", "v0", None),
    ],
)
def test_the_version_an_image_tag_names(image: str, tag: str | None, version: str | None) -> None:
    assert image_tag(image) == tag
    assert image_vllm_version(image) == version


def test_the_spec_wins_over_the_image(make_spec: SpecFactory, deployment: dict[str, Any]) -> None:
    spec = make_spec(serving={"vllmVersion": "0.31.2"})
    assert _served(spec, _with_image(deployment, "vllm/vllm-openai:v0.28.0")) == (
        "0.31.2",
        FROM_SPEC,
    )


def test_unset_the_version_is_the_vllm_containers_image_tag(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    """The example pod has two containers: the one ``containerName`` names is read."""
    version, reason = _served(make_spec(), _with_image(deployment, "vllm/vllm-openai:v0.28.1"))
    assert version == "0.28"
    assert reason == "from the tag of the vLLM container's image vllm/vllm-openai:v0.28.1"


@pytest.mark.parametrize(
    ("image", "why"),
    [
        ("vllm/vllm-openai@sha256:" + "1" * 64, "names no vLLM version in its tag"),
        ("vllm/vllm-openai:latest", "names no vLLM version in its tag"),
    ],
)
def test_a_tag_that_names_no_version_gives_the_default_and_says_so(
    make_spec: SpecFactory, deployment: dict[str, Any], image: str, why: str
) -> None:
    version, reason = _served(make_spec(), _with_image(deployment, image))
    assert version == layouts.DEFAULT_VLLM_VERSION
    assert reason == (
        f"the image {image} {why}: the default {layouts.DEFAULT_VLLM_VERSION}; set "
        "spec.serving.vllmVersion to the version the workload runs"
    )


def test_no_workload_or_one_that_did_not_opt_in_gives_the_default_and_is_not_read(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    version, reason = _served(make_spec(), None)
    assert (version, reason.split(":")[0]) == ("0.32", "Deployment vllm-llama is not found")
    foreign = _with_image(deployment, "vllm/vllm-openai:v0.9.0")  # would be refused if read
    foreign["metadata"]["annotations"].clear()
    version, reason = _served(make_spec(), foreign)
    assert (version, reason.split(":")[0]) == ("0.32", "Deployment vllm-llama has not opted in")


def test_an_unknown_container_gives_the_default(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    spec = make_spec(serving={"containerName": "server"})
    version, reason = _served(spec, deployment)
    assert version == "0.32"
    assert reason.startswith("the vLLM container of Deployment vllm-llama is not known: ")


@pytest.mark.parametrize("image", ["vllm/vllm-openai:v0.27.1", "vllm/vllm-openai:v0.33.0"])
def test_an_image_of_a_release_without_a_layout_is_refused(
    make_spec: SpecFactory, deployment: dict[str, Any], image: str
) -> None:
    with pytest.raises(SpecError) as refused:
        _served(make_spec(), _with_image(deployment, image))
    message = str(refused.value)
    assert message.startswith(f"the vLLM container's image {image} runs vLLM 0.")
    assert "has no known sharded layout; supported: 0.28, " in message
    assert message.endswith("set spec.serving.vllmVersion to the version it runs")


def test_a_spec_version_without_a_layout_is_refused(make_spec: SpecFactory) -> None:
    with pytest.raises(SpecError, match=r"'0\.27' has no known sharded layout"):
        _served(make_spec(serving={"vllmVersion": "0.27"}), None)


def test_every_release_of_the_table_shares_the_layout_and_so_the_digest(
    make_spec: SpecFactory,
) -> None:
    """0.28 to 0.32 give the same per-rank state (tests/vllm/test_vllm_versions.py): moving a
    workload between them restages nothing."""
    digests = {
        spec_digest(make_spec(serving={"vllmVersion": v}), IDENTITY) for v in layouts.LAYOUTS
    }
    assert len(layouts.LAYOUTS) >= 3 and len(digests) == 1


def test_a_release_with_another_layout_is_another_artifact(
    make_spec: SpecFactory, deployment: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image moving to a release whose layout differs restages: the digest changes, and the
    stage Job writes that release's layout."""
    other = dataclasses.replace(layouts.LAYOUTS["0.32"], vllm_version="0.40", layout_version="x/2")
    monkeypatch.setitem(layouts.LAYOUTS, "0.40", other)
    spec = make_spec()
    before = with_version(spec, _served(spec, deployment)[0])
    after = with_version(
        spec, _served(spec, _with_image(deployment, "vllm/vllm-openai:v0.40.0"))[0]
    )
    assert spec_digest(before, IDENTITY) != spec_digest(after, IDENTITY)
    owner = Owner(name=NAME, namespace=NAMESPACE, uid="u")
    job = plan_stage_job(after, owner=owner, artifact=artifact_at(after, namespace=owner.namespace, deployment_name=owner.name, digest=spec_digest(after, IDENTITY)))
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--vllm-version") + 1] == "0.40"


def test_an_artifact_seen_without_its_workload_uses_the_recorded_version(
    make_spec: SpecFactory,
) -> None:
    recorded = VllmVersionStatus(version="0.28", reason="from the tag")
    assert recorded_version(make_spec(), recorded) == "0.28"
    assert recorded_version(make_spec(), None) == layouts.DEFAULT_VLLM_VERSION
    assert recorded_version(make_spec(serving={"vllmVersion": "0.31"}), recorded) == "0.31"


def test_auto_splits_per_rank_only_what_is_proven_for_the_release(
    make_spec: SpecFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An architecture with rules but no proof on the serving release is cached in the
    Hugging Face layout, which that vLLM splits itself."""
    spec = make_spec(loadFormat="auto", serving={"vllmVersion": "0.28"})
    source = SourceStatus(
        uri=spec.model.uri, identity=IDENTITY, resolved_at=datetime(2026, 1, 1, tzinfo=UTC),
        key=source_key(spec), architecture="MixtralForCausalLM",
    )  # fmt: skip
    chosen = chosen_format(spec, source)
    assert chosen is not None and chosen.name == "sharded_state"
    unproven = dataclasses.replace(layouts.LAYOUTS["0.28"], architectures=frozenset({"X"}))
    monkeypatch.setitem(layouts.LAYOUTS, "0.28", unproven)
    chosen = chosen_format(spec, source)
    assert chosen is not None and chosen.name == "safetensors"
    assert "MixtralForCausalLM is not proven per rank for vLLM 0.28" in chosen.reason


def test_the_workload_check_does_not_depend_on_the_version(
    make_spec: SpecFactory, deployment: dict[str, Any]
) -> None:
    """Reading the image adds no rollout finding: the example workload stays clean."""
    spec = with_version(make_spec(), "0.28")
    assert validate_workload(spec, deployment, namespace=NAMESPACE, deployment_name=NAME) == []
