"""The operator reads the serving vLLM version from the workload's image tag when the spec
does not set it, says so in ``status.vllmVersion``, stages for it, refuses an image of a
release without a layout, and takes up a fixed image from the workload's own event."""

from __future__ import annotations

import pytest
from support.kube_cluster import Cluster, eventually
from support.modelstage_objects import (
    SPEC,
    deploy_path,
    digest_of,
    job_path,
    md_path,
    model_deployment,
    vllm_deployment,
)
from support.operator_flow import MD, condition, status_of, wait_job, wait_phase
from support.operator_process import OperatorProcess

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]


async def _set_image(cluster: Cluster, namespace: str, image: str) -> None:
    workload = await cluster.client.get(deploy_path(namespace))
    assert workload is not None
    containers = workload["spec"]["template"]["spec"]["containers"]
    containers[0]["image"] = image
    await cluster.client.patch(
        deploy_path(namespace), {"spec": {"template": {"spec": {"containers": containers}}}}
    )


async def test_the_image_tag_picks_the_version_and_a_release_without_a_layout_is_refused(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    workload = vllm_deployment(model_deployment=MD)
    workload["spec"]["template"]["spec"]["containers"][0]["image"] = "vllm/vllm-openai:v0.27.1"
    await cluster.client.create(deploy_path(namespace, None), workload)
    await cluster.client.create(md_path(namespace), model_deployment(MD, SPEC))
    status = await wait_phase(cluster, namespace, "Failed")
    staged = condition(status, "Staged")
    assert staged["reason"] == "UnsupportedVllmVersion"
    assert "image vllm/vllm-openai:v0.27.1 runs vLLM 0.27" in staged["message"]

    await _set_image(cluster, namespace, "vllm/vllm-openai:v0.28.0")
    digest = digest_of(SPEC)
    job = await wait_job(cluster, namespace, digest)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--vllm-version") + 1] == "0.28"

    async def recorded() -> dict[str, str] | None:
        version: dict[str, str] | None = (await status_of(cluster, namespace)).get("vllmVersion")
        return version if version and version["version"] == "0.28" else None

    version = await eventually(recorded, what="status.vllmVersion 0.28")
    assert version["reason"] == (
        "from the tag of the vLLM container's image vllm/vllm-openai:v0.28.0"
    )
    # 0.28 and 0.32 share a layout: the digest is the default version's, one Job.
    assert digest == digest_of({**SPEC, "serving": {**SPEC["serving"], "vllmVersion": "0.32"}})
    assert [j["metadata"]["name"] for j in await cluster.client.list(job_path(namespace))] == [
        job["metadata"]["name"]
    ]
