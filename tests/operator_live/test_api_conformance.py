"""The fake API server answers as a real one does, on the requests the operator makes.

The same requests run on both tiers (the real kube-apiserver when ``KUBEBUILDER_ASSETS`` is
set, else the fake), with the same expected answers: what ``tests/support/kube_rules.py``
copies from the API server is pinned here, so a fake that drifts from Kubernetes fails on the
real tier first. Each case is one behaviour a real cluster showed and the first fake did not.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.kube_cluster import ApiStatusError, Cluster, eventually
from support.modelstage_objects import deploy_path, job_path, vllm_deployment

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def job(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "registry.test/stager:1"}],
                }
            }
        },
    }


async def refused(coro: Any) -> ApiStatusError:
    with pytest.raises(ApiStatusError) as caught:
        await coro
    return caught.value


@pytest.mark.parametrize("param", ["timeoutSeconds", "limit"])
async def test_integer_query_parameters_refuse_a_fraction(
    cluster: Cluster, namespace: str, param: str
) -> None:
    """``strconv.ParseInt``: the float in a watch URL that stopped the operator."""
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments"
    extra = {"watch": "true"} if param == "timeoutSeconds" else {}
    error = await refused(cluster.client.request("GET", path, **extra, **{param: "300.0"}))
    assert error.status == 400
    assert error.body["message"] == 'strconv.ParseInt: parsing "300.0": invalid syntax'


async def test_a_label_value_over_63_characters_is_refused(
    cluster: Cluster, namespace: str
) -> None:
    error = await refused(cluster.client.create(job_path(namespace), job("j", owner="x" * 64)))
    assert (error.status, error.body["reason"]) == (422, "Invalid")
    assert "must be no more than 63 bytes" in error.body["message"]  # kube-apiserver 1.36
    await cluster.client.create(job_path(namespace), job("j", owner="x" * 63))


async def test_a_job_name_over_63_characters_is_refused_through_its_pod_label(
    cluster: Cluster, namespace: str
) -> None:
    error = await refused(cluster.client.create(job_path(namespace), job("j" * 64)))
    assert error.status == 422
    assert "spec.template.labels" in error.body["message"]


@pytest.mark.parametrize("name", ["Bad_Name", "a" * 254])
async def test_an_invalid_object_name_is_refused(
    cluster: Cluster, namespace: str, name: str
) -> None:
    error = await refused(
        cluster.client.create(deploy_path(namespace, None), vllm_deployment(name))
    )
    assert (error.status, error.body["reason"]) == (422, "Invalid")
    assert "metadata.name" in error.body["message"]


async def test_a_job_is_stored_with_the_defaults_the_operator_reads_back(
    cluster: Cluster, namespace: str
) -> None:
    created = await cluster.client.create(job_path(namespace), job("defaults"))
    spec = created["spec"]
    assert (spec["completionMode"], spec["backoffLimit"], spec["completions"]) == (
        "NonIndexed", 6, 1
    )  # fmt: skip
    labels = spec["template"]["metadata"]["labels"]
    assert labels["batch.kubernetes.io/job-name"] == "defaults"
    assert spec["selector"]["matchLabels"] == {
        "batch.kubernetes.io/controller-uid": created["metadata"]["uid"]
    }
    [container] = spec["template"]["spec"]["containers"]
    assert (container["terminationMessagePolicy"], container["imagePullPolicy"]) == (
        "File", "IfNotPresent"
    )  # fmt: skip


async def test_a_deployment_is_stored_with_its_defaults(cluster: Cluster, namespace: str) -> None:
    created = await cluster.client.create(deploy_path(namespace, None), vllm_deployment("d"))
    spec = created["spec"]
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"},
    }
    assert (spec["revisionHistoryLimit"], spec["progressDeadlineSeconds"]) == (10, 600)
    assert spec["template"]["spec"]["restartPolicy"] == "Always"


async def test_a_job_template_and_a_deployment_selector_are_immutable(
    cluster: Cluster, namespace: str
) -> None:
    await cluster.client.create(job_path(namespace), job("frozen"))
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "other:2"}]}}}}
    error = await refused(cluster.client.patch(job_path(namespace, "frozen"), patch))
    assert error.status == 422 and "spec.template" in error.body["message"]

    await cluster.client.create(deploy_path(namespace, None), vllm_deployment("d"))
    patch = {"spec": {"selector": {"matchLabels": {"app": "e"}},
                      "template": {"metadata": {"labels": {"app": "e"}}}}}  # fmt: skip
    error = await refused(cluster.client.patch(deploy_path(namespace, "d"), patch))
    assert error.status == 422 and "field is immutable" in error.body["message"]


async def test_objects_go_only_into_a_live_namespace(cluster: Cluster, namespace: str) -> None:
    error = await refused(cluster.client.create(job_path("no-such-namespace"), job("j")))
    assert (error.status, error.body["message"]) == (
        404,
        'namespaces "no-such-namespace" not found',
    )

    await cluster.client.create(job_path(namespace), job("inside"))
    await cluster.client.delete(f"/api/v1/namespaces/{namespace}")
    # Terminating: new content is refused, then the contents go, then the namespace.
    error = await refused(cluster.client.create(job_path(namespace), job("late")))
    assert error.status in (403, 404)

    async def gone() -> bool:
        return await cluster.client.get(f"/api/v1/namespaces/{namespace}") is None

    await eventually(gone, timeout=45, what="the namespace deleted with its contents")


async def test_an_owned_object_is_collected_when_its_owner_goes(
    cluster: Cluster, namespace: str
) -> None:
    owner = await cluster.client.create(deploy_path(namespace, None), vllm_deployment("owner"))
    reference = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "owner",
                 "uid": owner["metadata"]["uid"]}  # fmt: skip
    child = job("child")
    child["metadata"]["ownerReferences"] = [reference]
    await cluster.client.create(job_path(namespace), child)
    await cluster.client.delete(deploy_path(namespace, "owner"))

    async def collected() -> bool:
        return await cluster.client.get(job_path(namespace, "child")) is None

    await eventually(collected, timeout=30, what="the owned Job garbage-collected")
