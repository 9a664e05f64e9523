"""``loadFormat: auto`` through the operator (tier: kmock, or the real control plane when
``KUBEBUILDER_ASSETS`` is set): the resolve Job is asked to describe the checkpoint (even for
a pinned commit), and what it reports picks the format: a Llama checkpoint is staged per rank
(``sharded_state``), an OLMo 2 or a quantized one in the Hugging Face layout (``safetensors``,
served through the plugin's ``modelstage_safetensors``); ``status.format`` says which and why.
The tests play the Job controller and the kubelet."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.api.modeldeployment import ModelDeploymentSpec, SourceStatus
from modelstage.operator.resolve_plan import resolve_job_name
from support.kube_cluster import Cluster
from support.modelstage_objects import (
    COMMIT,
    SPEC,
    complete_rollout,
    digest_of,
    finish_stage_job,
    merged,
    summary,
)
from support.operator_flow import (
    MD,
    apply,
    condition,
    status_of,
    wait_job,
    wait_named_job,
    wait_phase,
    wait_rolled,
)
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
AUTO = merged(SPEC, {"loadFormat": "auto"})  # SPEC pins a commit


def described(architecture: str, quantization: str | None = None) -> str:
    """``modelstage resolve --describe``'s line for the pinned commit."""
    return json.dumps({"uri": AUTO["model"]["uri"], "revision": COMMIT, "kind": "hf",
                       "identity": f"commit:{COMMIT}", "commit": COMMIT,
                       "architecture": architecture, "quantization": quantization})  # fmt: skip


async def resolve_and_stage(
    cluster: Cluster, ns: str, report: str, fmt: str
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Apply AUTO, play its resolve Job with ``report``; returns the digest of the artifact
    in ``fmt``, its stage Job and the status once the Job exists."""
    await apply(cluster, ns, AUTO)
    name = resolve_job_name(ModelDeploymentSpec.model_validate(AUTO), None, MD)
    job = await wait_named_job(cluster, ns, name)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["modelstage", "resolve"]
    assert "--describe" in container["command"]
    status = await wait_phase(cluster, ns, "Pending")
    assert condition(status, "Staged")["reason"] == "Resolving" and "format" not in status
    await finish_stage_job(cluster.client, ns, "", message=report, succeeded=True,
                           job_name=name, container="resolve")  # fmt: skip
    digest = digest_of(merged(AUTO, {"loadFormat": fmt}), f"commit:{COMMIT}")
    stage = await wait_job(cluster, ns, digest)
    return digest, stage, await status_of(cluster, ns)


def command_of(job: dict[str, Any]) -> list[str]:
    command: list[str] = job["spec"]["template"]["spec"]["containers"][0]["command"]
    return command


async def test_auto_stages_a_table_architecture_per_rank(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    digest, stage, status = await resolve_and_stage(
        cluster, namespace, described("LlamaForCausalLM"), "sharded_state"
    )
    command = command_of(stage)
    assert command[command.index("--format") + 1] == "sharded_state"
    assert status["format"] == {
        "name": "sharded_state",
        "reason": "architecture LlamaForCausalLM is split per rank: staged as sharded_state",
    }
    assert status["source"]["architecture"] == "LlamaForCausalLM"
    assert digest == digest_of(SPEC)  # the same artifact as naming sharded_state


@pytest.mark.parametrize(
    ("report", "why"),
    [
        (described("Olmo2ForCausalLM"),
         "architecture Olmo2ForCausalLM has no per-rank rules: cached in the Hugging Face "
         "layout (safetensors)"),
        (described("LlamaForCausalLM", "compressed-tensors"),
         "the checkpoint is quantized (compressed-tensors), which is not split per rank: "
         "cached in the Hugging Face layout (safetensors)"),
    ],
    ids=["olmo2", "quantized"],
)  # fmt: skip
async def test_auto_caches_anything_else_in_the_hugging_face_layout_and_says_why(
    cluster: Cluster, namespace: str, operator: OperatorProcess, report: str, why: str
) -> None:
    digest, stage, status = await resolve_and_stage(cluster, namespace, report, "safetensors")
    command = command_of(stage)
    assert command[command.index("--format") + 1] == "safetensors"
    assert status["format"] == {"name": "safetensors", "reason": why}

    await finish_stage_job(cluster.client, namespace, digest, message=summary(digest),
                           succeeded=True)  # fmt: skip
    workload = await wait_rolled(cluster, namespace, digest)
    [vllm] = workload["spec"]["template"]["spec"]["containers"]
    args = vllm["args"]
    assert args[args.index("--load-format") + 1] == "modelstage_safetensors"
    assert f"/mnt/modelstage/artifacts/artifacts/{namespace}/{digest}" in args
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["MODELSTAGE_FORMAT"] == "safetensors"
    await complete_rollout(cluster.client, namespace)
    status = await wait_phase(cluster, namespace, "Ready")
    assert status["artifact"]["format"] == "safetensors"
    assert status["format"]["reason"] == why


BRANCH = merged(AUTO, {"model": {"revision": "main"}})
COMMIT_B = "b2" * 20


@pytest_asyncio.fixture
async def resolving(cluster: Cluster, namespace: str, tmp_path: Path) -> AsyncIterator[None]:
    """An operator that resolves moving sources every 2 s and re-reads every second."""
    process = OperatorProcess(cluster.kubeconfig, namespace, tmp_path, extra_env={
        "MODELSTAGE_OPERATOR_RESOLVE_INTERVAL": "2",
        "MODELSTAGE_OPERATOR_RESYNC_INTERVAL": "1",
    })  # fmt: skip
    await process.start()
    try:
        yield
    finally:
        await process.stop(graceful=False)


async def branch_resolve_job(cluster: Cluster, ns: str) -> dict[str, Any]:
    status = await status_of(cluster, ns)
    recorded = SourceStatus.model_validate(status["source"]) if status.get("source") else None
    name = resolve_job_name(ModelDeploymentSpec.model_validate(BRANCH), recorded, MD)
    job = await wait_named_job(cluster, ns, name)
    assert "--describe" in command_of(job)  # every round reads the architecture again
    return job


def moved(commit: str, architecture: str) -> str:
    return json.dumps({"uri": BRANCH["model"]["uri"], "revision": "main", "kind": "hf",
                       "identity": f"commit:{commit}", "commit": commit,
                       "architecture": architecture, "quantization": None})  # fmt: skip


async def test_a_branch_that_moves_to_another_architecture_is_restaged_in_its_format(
    cluster: Cluster, namespace: str, resolving: None
) -> None:
    await apply(cluster, namespace, BRANCH)
    job = await branch_resolve_job(cluster, namespace)
    await finish_stage_job(cluster.client, namespace, "", message=moved(COMMIT, "LlamaForCausalLM"),
                           succeeded=True, job_name=job["metadata"]["name"], container="resolve")  # fmt: skip
    old = digest_of(merged(BRANCH, {"loadFormat": "sharded_state"}), f"commit:{COMMIT}")
    await wait_job(cluster, namespace, old)
    await finish_stage_job(cluster.client, namespace, old, message=summary(old), succeeded=True)
    await wait_rolled(cluster, namespace, old)
    await complete_rollout(cluster.client, namespace)
    await wait_phase(cluster, namespace, "Ready")

    # main moves to an OLMo 2 checkpoint: the next round reads it, auto picks safetensors.
    job = await branch_resolve_job(cluster, namespace)
    await finish_stage_job(cluster.client, namespace, "", message=moved(COMMIT_B, "Olmo2ForCausalLM"),
                           succeeded=True, job_name=job["metadata"]["name"], container="resolve")  # fmt: skip
    new = digest_of(merged(BRANCH, {"loadFormat": "safetensors"}), f"commit:{COMMIT_B}")
    stage = await wait_job(cluster, namespace, new)
    command = command_of(stage)
    assert command[command.index("--format") + 1] == "safetensors"
    status = await status_of(cluster, namespace)
    assert status["format"]["name"] == "safetensors"
    assert status["artifact"]["digest"] == old  # stage before roll: the old one serves
    await finish_stage_job(cluster.client, namespace, new, message=summary(new), succeeded=True)
    workload = await wait_rolled(cluster, namespace, new)
    args = workload["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--load-format") + 1] == "modelstage_safetensors"
