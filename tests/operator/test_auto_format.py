"""``loadFormat: auto``: the resolve Job reads the checkpoint's architecture and quantization
(``modelstage resolve --describe``), the operator picks per-rank staging for the stager's
table and the Hugging Face layout otherwise, and the status says which and why. Pure planners
here; the live tiers (tests/operator_live/test_operator_auto.py) drive the whole loop."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from modelstage.api.modeldeployment import ModelDeploymentSpec, ModelDeploymentStatus
from modelstage.api.objects import Owner
from modelstage.core.model_config import FP8_CHANNEL
from modelstage.operator.artifact import artifact_for, spec_digest
from modelstage.operator.job_plan import plan_resolve_job
from modelstage.operator.observations import JobObservation, Observed
from modelstage.operator.resolve_plan import (
    SourceStep,
    chosen_format,
    concrete_spec,
    pinned_identity,
    plan_source,
    resolution_due,
)
from modelstage.operator.state import Action, decide

SpecFactory = Callable[..., ModelDeploymentSpec]
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OWNER = Owner(name="llama", namespace="llm", uid="5f1c0000-0000-4000-8000-000000000001")
COMMIT = "c3" * 20
S3 = {"pvc": None, "s3": {"uri": "s3://bkt/artifacts"}}


def report(**extra: Any) -> str:
    return json.dumps({"uri": "hf://org/m", "identity": f"commit:{COMMIT}", "commit": COMMIT,
                       "kind": "hf", **extra})  # fmt: skip


def resolved(spec: ModelDeploymentSpec, message: str) -> SourceStep:
    done = plan_source(spec, None, owner="llama", now=T0, interval=0,
                       job=JobObservation("Succeeded", message))  # fmt: skip
    assert done.state == "resolved" and done.source is not None
    return done


@pytest.mark.parametrize(
    ("storage", "reported", "fmt", "why"),
    [
        ({}, {"architecture": "LlamaForCausalLM", "quantization": None}, "sharded_state",
         "architecture LlamaForCausalLM is split per rank: staged as sharded_state"),
        (S3, {"architecture": "Qwen3ForCausalLM", "quantization": None},
         "runai_streamer_sharded", "is split per rank: staged as runai_streamer_sharded"),
        ({}, {"architecture": "Olmo2ForCausalLM", "quantization": None}, "safetensors",
         "architecture Olmo2ForCausalLM has no per-rank rules: cached in the Hugging Face "
         "layout (safetensors)"),
        (S3, {"architecture": "Olmo2ForCausalLM", "quantization": None}, "runai_streamer",
         "has no per-rank rules: cached in the Hugging Face layout (runai_streamer)"),
        ({}, {"architecture": "LlamaForCausalLM", "quantization": "fp8"}, "safetensors",
         "the checkpoint is quantized (fp8), which is not split per rank: cached in the Hugging "
         "Face layout (safetensors)"),
        (S3, {"architecture": "LlamaForCausalLM", "quantization": FP8_CHANNEL},
         "runai_streamer_sharded", f"architecture LlamaForCausalLM ({FP8_CHANNEL}) is split per "
         "rank: staged as runai_streamer_sharded"),
        ({}, {"architecture": "MixtralForCausalLM", "quantization": FP8_CHANNEL}, "safetensors",
         f"architecture MixtralForCausalLM has no per-rank rules for {FP8_CHANNEL}: cached in "
         "the Hugging Face layout (safetensors)"),
        ({}, {}, "safetensors", "config.json names no single architecture"),
    ],
)  # fmt: skip
def test_auto_chooses_by_what_the_resolve_job_read_and_says_why(
    make_spec: SpecFactory, storage: dict[str, Any], reported: dict[str, Any], fmt: str, why: str
) -> None:
    spec = make_spec(loadFormat="auto", model={"revision": "main"}, storage=storage)
    source = resolved(spec, report(**reported))
    chosen = chosen_format(spec, source.source)
    assert chosen is not None and chosen.name == fmt and why in chosen.reason
    concrete = concrete_spec(spec, chosen)
    assert concrete.load_format == fmt and spec.load_format == "auto"
    desired = artifact_for(concrete, namespace="llm", deployment_name="llama",
                           identity=f"commit:{COMMIT}")  # fmt: skip
    assert desired.load_format == fmt
    # The digest is the explicit format's: auto and naming the format share the artifact.
    explicit = make_spec(loadFormat=fmt, model={"revision": "main"}, storage=storage)
    assert desired.digest == spec_digest(explicit, f"commit:{COMMIT}")


def test_an_explicit_format_is_kept_as_it_was(make_spec: SpecFactory) -> None:
    spec = make_spec(loadFormat="tensorizer", model={"revision": COMMIT})
    assert pinned_identity(spec) == f"commit:{COMMIT}"  # no resolve Job, as before
    chosen = chosen_format(spec, None)
    assert chosen is not None and (chosen.name, chosen.reason) == (
        "tensorizer",
        "set in spec.loadFormat",
    )
    assert "--describe" not in plan_resolve_job(make_spec(loadFormat="tensorizer"),
                                               owner=OWNER, name="r")["spec"]["template"]["spec"][
        "containers"][0]["command"]  # fmt: skip


def test_auto_resolves_a_pinned_commit_once_to_read_its_architecture(
    make_spec: SpecFactory,
) -> None:
    spec = make_spec(loadFormat="auto", model={"revision": COMMIT})
    assert pinned_identity(spec) is None
    first = plan_source(spec, None, owner="llama", now=T0, interval=600, job=None)
    assert (first.state, first.source) == ("create", None)
    command = plan_resolve_job(spec, owner=OWNER, name=first.job_name)["spec"]["template"][
        "spec"]["containers"][0]["command"]  # fmt: skip
    assert command[:2] == ["modelstage", "resolve"] and "--describe" in command
    done = resolved(spec, report(architecture="LlamaForCausalLM", quantization=None))
    later = T0 + timedelta(days=30)
    assert not resolution_due(spec, done.source, now=later, interval=600)  # a commit never moves


def test_a_recorded_resolution_without_the_architecture_is_resolved_again(
    make_spec: SpecFactory,
) -> None:
    """A status written before auto existed: the identity alone cannot choose a format."""
    explicit = make_spec(loadFormat="sharded_state", model={"revision": "main"})
    old = resolved(explicit, json.dumps({"identity": f"commit:{COMMIT}", "commit": COMMIT}))
    assert old.source is not None
    old_source = old.source.model_copy(update={"architecture": None})
    spec = make_spec(loadFormat="auto", model={"revision": "main"})
    assert resolution_due(spec, old_source, now=T0, interval=0)
    again = plan_source(spec, old_source, owner="llama", now=T0, interval=0, job=None)
    assert (again.state, again.source) == ("create", None)
    d = decide(None, ModelDeploymentStatus(source=old_source),
               Observed(generation=1, now=T0), again)  # fmt: skip
    assert d.action is Action.CREATE_RESOLVE_JOB and d.status.phase == "Pending"


def test_the_status_records_the_chosen_format_and_why(make_spec: SpecFactory) -> None:
    spec = make_spec(loadFormat="auto", model={"revision": "main"})
    source = resolved(spec, report(architecture="Olmo2ForCausalLM", quantization=None))
    chosen = chosen_format(spec, source.source)
    assert chosen is not None
    desired = artifact_for(concrete_spec(spec, chosen), namespace="llm",
                           deployment_name="llama", identity=f"commit:{COMMIT}")  # fmt: skip
    desired = replace(desired, format_reason=chosen.reason)
    d = decide(desired, ModelDeploymentStatus(), Observed(generation=1, now=T0), source)
    assert d.status.format is not None
    assert d.status.format.name == "safetensors"
    assert d.status.format.reason.startswith("architecture Olmo2ForCausalLM has no per-rank")
    wire = d.status.wire()
    assert wire["format"]["name"] == "safetensors" and wire["source"]["architecture"] == (
        "Olmo2ForCausalLM"
    )


def test_an_overlong_report_is_cut_for_the_status(make_spec: SpecFactory) -> None:
    spec = make_spec(loadFormat="auto", model={"revision": "main"})
    source = resolved(spec, report(architecture="X" * 5000, quantization="q" * 5000))
    assert source.source is not None
    assert len(source.source.architecture or "") == 200
    assert len(source.source.quantization or "") == 200
