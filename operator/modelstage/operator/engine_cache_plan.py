"""``spec + artifact + workload -> capture Job``, and where the engine cache stands.

The engine cache (``core/engine_cache.py``) is captured once per weights artifact, serving
configuration and hardware class by a Job that runs the workload's own vLLM image, with the
plugin and the capture command installed by an initContainer of the stager image (as the
serving pods' prepare installs the plugin), on a node of the serving class, against the staged
artifact mounted where the serving pods mount it (the model path is in vLLM's own key).

What the operator can know of vLLM's key it reads from the spec and the workload: the image,
the engine arguments of the vLLM command line (TP from the artifact, ``--max-model-len``,
``--dtype``, ``--quantization``, ``--enforce-eager``, ``--compilation-config``,
``--pipeline-parallel-size``, the load format the roll sets), the compile environment the
container sets, and the node selector the capture runs under (the hardware class). Its
*capture key* hashes those with the artifact digest; the cache's address is a pure function
of the two (``<artifact>.engine-<key>``, a sibling of the artifact folder), so a changed
argument or image is a new address and a new capture. What the operator cannot know (the torch
version inside the image, the CPU's instruction set) the capture measures and records in the
cache's manifest; the serving pods' prepare checks the whole key before vLLM starts.

``plan_engine_cache`` is the pure step the state machine consults before a roll: create the
capture Job, wait for it (until ``deadlineSeconds``), then roll with the cache or without it.
A capture that fails or is late never blocks the roll beyond the deadline and never fails the
ModelDeployment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from modelstage.api.modeldeployment import (
    DEFAULT_STAGER_IMAGE,
    EngineCache,
    EngineCacheStatus,
    ModelDeploymentSpec,
)
from modelstage.api.objects import KubeObject, Owner, labels
from modelstage.core.engine_key import EngineArgs, compile_environment, key_of
from modelstage.core.errors import SpecError

from .artifact import ARTIFACT_MOUNT, Artifact
from .job_plan import _job, _s3_flags
from .kube import (
    PLUGIN_DIR,
    SCRATCH_DIR,
    TOKEN_DIR,
    VOLUME_ARTIFACTS,
    VOLUME_NO_TOKEN,
    VOLUME_PLUGINS,
    VOLUME_SCRATCH,
    ca_mount,
    ca_volume,
    container_security_context,
    pod_security_context,
)
from .observations import EngineCacheStep, JobObservation, parse_capture
from .rollout_plan import (
    EngineCacheUse,
    _s3_serving_env,
    partition_env,
    select_container,
    vllm_settings,
)
from .serving_version import image_vllm_version
from .vllm_args import flag_name, vllm_arguments

CAPTURE_COMPONENT = "engine-capture"
ENGINE_CACHE_URI_ANNOTATION = "modelstage.io/engine-cache-uri"
"""On a capture Job: the engine cache it writes."""
CAPTURE_CONTAINER = "capture"
INSTALL_CONTAINER = "modelstage-install"
CAPTURE_KEY_VERSION = 1
CAPTURE_DEFAULT_ENV = {"VLLM_USE_AOT_COMPILE": "0"}
"""What ``capture-engine-cache`` sets unless told otherwise (``stager/engine_capture.py``,
held equal by a test): it is in vLLM's key, so the serving container gets it too."""
CAPTURE_ENV_PREFIXES = ("VLLM_", "TORCHINDUCTOR_")
"""The vLLM container's variables the capture runs with (literal values only)."""
MIN_DEADLINE_SECONDS = 60
CAPTURE_BACKOFF_LIMIT = 0
"""A capture that failed once would fail again the same way: report it, roll without."""
ENGINE_FLAGS = {
    "--max-model-len": "maxModelLen",
    "--dtype": "dtype",
    "--quantization": "quantization",
    "-q": "quantization",
    "--compilation-config": "compilationConfig",
    "-O": "compilationConfig",
    "--pipeline-parallel-size": "pipelineParallelSize",
    "-pp": "pipelineParallelSize",
}
"""vLLM's flags (and aliases) that enter its ``compute_hash``, by ``EngineArgs`` field."""
BOOL_FLAGS = {"--enforce-eager": True, "--no-enforce-eager": False}


@dataclass(frozen=True)
class Unavailable:
    """Why this workload gets no capture; ``finding``: a mistake worth the ``Degraded``
    condition (else only ``EngineCached`` says it, e.g. an eager-only engine)."""

    reason: str
    message: str
    finding: bool = True


@dataclass(frozen=True)
class CaptureInputs:
    """What the capture runs with, read from the spec and the workload."""

    image: str
    model_path: str
    engine_args: EngineArgs
    env: tuple[tuple[str, str], ...]
    """The vLLM container's ``VLLM_*``/``TORCHINDUCTOR_*`` variables, plus the capture's
    defaults it does not set."""
    node_selector: Mapping[str, str]
    tolerations: tuple[KubeObject, ...] = ()
    resources: KubeObject = field(default_factory=dict)

    def factors(self, digest: str) -> dict[str, Any]:
        return {
            "captureKeyVersion": CAPTURE_KEY_VERSION,
            "weightsDigest": digest,
            "image": self.image,
            "modelPath": self.model_path,
            "engineArgs": self.engine_args.to_doc(),
            "environment": compile_environment(dict(self.env)),
            "nodeSelector": dict(sorted(self.node_selector.items())),
        }

    def key(self, digest: str) -> str:
        return key_of(self.factors(digest))


def cache_path(artifact: Artifact, key: str) -> str:
    """The engine cache's folder in pods: a sibling of the artifact's, named by the key."""
    return f"{artifact.location.path}.engine-{key}"


def cache_uri(artifact: Artifact, key: str) -> str:
    return f"{artifact.location.uri}.engine-{key}"


def capture_job_name(key: str) -> str:
    return f"modelstage-engine-{key}"


def capture_inputs(
    spec: ModelDeploymentSpec, artifact: Artifact, workload: KubeObject
) -> CaptureInputs | Unavailable:
    """The capture's inputs, or why there is none (the roll then goes on without a cache)."""
    if not spec.serving.plugin:
        return Unavailable("EngineCacheNeedsPlugin", "spec.engineCache: the serving pods' "
                           "prepare places the cache, and it runs only with "
                           "spec.serving.plugin: true")  # fmt: skip
    pod: KubeObject = (workload.get("spec") or {}).get("template", {}).get("spec") or {}
    try:
        container = select_container(spec, pod)
        tokens = vllm_arguments(container.get("command"), container.get("args"))
        engine_args = _engine_args(tokens, artifact, spec.serving.plugin)
    except SpecError as error:
        return Unavailable("EngineCacheArgs", f"spec.engineCache: {error}")
    image = str(container.get("image") or "")
    if not image or (spec.serving.vllm_version is None and image_vllm_version(image) is None):
        return Unavailable("EngineCacheImageUnknown", f"spec.engineCache: the vLLM container's "
                           f"image {image or '(none)'} names no vLLM release in its tag: the "
                           "operator captures only for an image it knows; tag it with its "
                           "release or set spec.serving.vllmVersion")  # fmt: skip
    if engine_args.enforceEager:
        return Unavailable("NothingToCompile", "the vLLM arguments set --enforce-eager: vLLM "
                           "compiles nothing, so there is no engine cache to capture; the "
                           "roll goes on without one", finding=False)  # fmt: skip
    capture = spec.engine_cache.capture
    return CaptureInputs(
        image=image,
        model_path=artifact.location.path,
        engine_args=engine_args,
        env=_capture_env(container),
        node_selector=dict(capture.node_selector or pod.get("nodeSelector") or {}),
        tolerations=tuple(
            t.wire() for t in capture.tolerations or ()
        ) or tuple(dict(t) for t in pod.get("tolerations") or ()),
        resources=(capture.resources.wire() if capture.resources else None)
        or dict(container.get("resources") or {}),
    )


def _engine_args(tokens: Sequence[str], artifact: Artifact, plugin: bool) -> EngineArgs:
    """The engine arguments of vLLM's command line (the last occurrence of a flag wins, as
    in vLLM's argparse); ``SpecError`` naming the flag when one cannot be read."""
    doc: dict[str, Any] = {
        "tensorParallelSize": artifact.tp,
        "loadFormat": vllm_settings(artifact, plugin).load_format,
    }
    for i, token in enumerate(tokens):
        name = flag_name(token)
        if name in BOOL_FLAGS:
            doc["enforceEager"] = BOOL_FLAGS[name]
            continue
        if name is None or name.split("=")[0] not in ENGINE_FLAGS:
            if token.startswith("-O") and not token.startswith("--") and len(token) > 2:
                doc["compilationConfig"] = token[2:]  # -O3
            continue
        key = ENGINE_FLAGS[name.split("=")[0]]
        value = token.split("=", 1)[1] if "=" in token else _next(tokens, i, name)
        doc[key] = _typed(key, name, value)
    if "maxModelLen" not in doc:
        raise SpecError(
            "the vLLM arguments have no --max-model-len: it shapes the compiled graph, and the "
            "operator captures only for a length it knows; add it"
        )
    return EngineArgs.parse(json.dumps(doc), "the vLLM arguments")


def _next(tokens: Sequence[str], i: int, name: str) -> str:
    if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
        raise SpecError(f"the vLLM argument {name} has no value")
    return tokens[i + 1]


def _typed(key: str, name: str, value: str) -> Any:
    if key in ("maxModelLen", "pipelineParallelSize"):
        try:
            return int(value)
        except ValueError:
            raise SpecError(f"the vLLM argument {name} {value!r} is not a number") from None
    if key == "compilationConfig":
        try:
            parsed = json.loads(value)
        except ValueError:
            raise SpecError(
                f"the vLLM argument {name} {value!r} is neither a level nor a JSON object; the "
                "engine cache reads those two forms only"
            ) from None
        return json.dumps(parsed, sort_keys=True, separators=(",", ":"))
    return value


def _capture_env(container: KubeObject) -> tuple[tuple[str, str], ...]:
    env = {
        str(e["name"]): str(e["value"])
        for e in container.get("env") or []
        if str(e.get("name", "")).startswith(CAPTURE_ENV_PREFIXES) and "value" in e
    }
    return tuple(sorted({**CAPTURE_DEFAULT_ENV, **env}.items()))


def plan_capture_job(
    spec: ModelDeploymentSpec,
    artifact: Artifact,
    inputs: CaptureInputs,
    *,
    owner: Owner,
    default_image: str = DEFAULT_STAGER_IMAGE,
) -> KubeObject:
    """The capture Job: the stager image installs the plugin and the capture command into an
    ``emptyDir`` (``prepare --install-capture``, which also verifies the artifact), then the
    vLLM image runs ``capture-engine-cache`` on a node of the serving class; restricted (non-
    root, no privilege escalation, no capabilities, RuntimeDefault seccomp), no API token,
    never retried, ``activeDeadlineSeconds`` from ``spec.engineCache.deadlineSeconds``."""
    key = inputs.key(artifact.digest)
    deadline = max(spec.engine_cache.deadline_seconds, MIN_DEADLINE_SECONDS)
    store = _Store.of(spec, artifact)
    volumes: list[KubeObject] = [
        {"name": VOLUME_SCRATCH, "emptyDir": {}},
        {"name": VOLUME_PLUGINS, "emptyDir": {}},
        {"name": VOLUME_NO_TOKEN, "emptyDir": {"sizeLimit": "1Mi"}},
        *store.volumes,
    ]
    pod: KubeObject = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "initContainers": [_install_container(spec, artifact, default_image, store)],
        "containers": [_capture_container(artifact, inputs, key, deadline, store)],
        "volumes": volumes,
    }
    if inputs.node_selector:
        pod["nodeSelector"] = dict(inputs.node_selector)
    if inputs.tolerations:
        pod["tolerations"] = [dict(t) for t in inputs.tolerations]
    job_labels = labels(CAPTURE_COMPONENT, owner.name, artifact.digest)
    job_spec = {
        "backoffLimit": CAPTURE_BACKOFF_LIMIT,
        "activeDeadlineSeconds": deadline,
        "template": {"metadata": {"labels": job_labels}, "spec": pod},
    }
    annotations = {ENGINE_CACHE_URI_ANNOTATION: cache_uri(artifact, key)}
    return _job(capture_job_name(key), owner.namespace, job_labels, annotations, job_spec, owner)


@dataclass(frozen=True)
class _Store:
    """How the capture's containers reach the artifact and the cache's place: its PVC
    mounted where the serving pods mount it, or its S3 prefix (the connection's flags, its
    endpoint and credentials by reference, its CA bundle), as the stager Jobs reach it."""

    volumes: list[KubeObject]
    mounts: list[KubeObject]
    flags: list[str]
    env: list[KubeObject]

    @staticmethod
    def of(spec: ModelDeploymentSpec, artifact: Artifact) -> _Store:
        if artifact.location.on_pvc:
            claim = {"claimName": artifact.location.claim_name}
            return _Store(
                volumes=[{"name": VOLUME_ARTIFACTS, "persistentVolumeClaim": claim}],
                mounts=[{"name": VOLUME_ARTIFACTS, "mountPath": ARTIFACT_MOUNT}],
                flags=[], env=[],
            )  # fmt: skip
        connection = spec.storage.s3
        return _Store(ca_volume(connection), ca_mount(connection), _s3_flags(connection),
                      _s3_serving_env(artifact, connection))  # fmt: skip


def _install_container(
    spec: ModelDeploymentSpec, artifact: Artifact, image: str, store: _Store
) -> KubeObject:
    read_only = [{**m, "readOnly": True} for m in store.mounts]
    container: KubeObject = {
        "name": INSTALL_CONTAINER,
        "image": spec.stager.image or image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["modelstage", "prepare", "--artifact", artifact.location.path,
                    "--digest", artifact.digest, "--tp", str(artifact.tp),
                    "--plugin-dir", PLUGIN_DIR, "--install-capture", *store.flags],
        "volumeMounts": [
            {"name": VOLUME_PLUGINS, "mountPath": PLUGIN_DIR},
            {"name": VOLUME_NO_TOKEN, "mountPath": TOKEN_DIR, "readOnly": True},
            *read_only,
        ],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "512Mi"}},
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if store.env:
        container["env"] = store.env
    return container


def _capture_container(
    artifact: Artifact, inputs: CaptureInputs, key: str, deadline: int, store: _Store
) -> KubeObject:
    """The vLLM image running the capture; its root file system stays writable (vLLM and
    its compilers write beside their caches), everything else as restricted as the stager."""
    security = {**container_security_context(), "readOnlyRootFilesystem": False}
    env = [
        {"name": "PYTHONPATH", "value": PLUGIN_DIR},
        {"name": "HOME", "value": SCRATCH_DIR},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
        {"name": "MODELSTAGE_DIGEST", "value": artifact.digest},
        {"name": "MODELSTAGE_FORMAT", "value": artifact.load_format},
        {"name": "MODELSTAGE_TP", "value": str(artifact.tp)},
        {"name": "MODELSTAGE_ARTIFACT", "value": artifact.location.path},
        *partition_env(artifact),
        *store.env,
        *({"name": name, "value": value} for name, value in inputs.env),
    ]
    container: KubeObject = {
        "name": CAPTURE_CONTAINER,
        "image": inputs.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "modelstage.stager.cli", "capture-engine-cache",
                    "--artifact", artifact.location.path, "--out", cache_path(artifact, key),
                    "--engine-args", json.dumps(inputs.engine_args.to_doc(), sort_keys=True),
                    "--timeout", str(deadline), *store.flags],
        "env": env,
        "volumeMounts": [
            {"name": VOLUME_SCRATCH, "mountPath": SCRATCH_DIR},
            {"name": VOLUME_PLUGINS, "mountPath": PLUGIN_DIR, "readOnly": True},
            *store.mounts,
        ],
        "securityContext": security,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if inputs.resources:
        container["resources"] = dict(inputs.resources)
    return container


# --- where the capture stands -----------------------------------------------------------------

def plan_engine_cache(
    config: EngineCache,
    artifact: Artifact,
    inputs: CaptureInputs | Unavailable,
    *,
    before: EngineCacheStatus | None,
    job: JobObservation | None,
    planned: KubeObject | None,
    now: datetime,
) -> EngineCacheStep:
    """The step for this reconciliation: ``job`` is the observed capture Job of the key (None
    when there is none), ``planned`` the one to create then (``plan_capture_job``). Captured
    before under the same key: used, whatever became of its Job."""
    if isinstance(inputs, Unavailable):
        return EngineCacheStep(None, ("False", inputs.reason, inputs.message), roll=True)
    key = inputs.key(artifact.digest)
    uri = cache_uri(artifact, key)
    same = before is not None and before.key == key and before.digest == artifact.digest
    retried = job is None and same and before is not None and before.phase != "Capturing"
    since = before.since if same and before is not None and before.since and not retried else now
    base = EngineCacheStatus(digest=artifact.digest, key=key, uri=uri, phase="Capturing",
                             since=since)  # fmt: skip
    if same and before is not None and before.phase == "Captured" and before.config:
        return _captured(before, artifact, key)
    late = (now - since).total_seconds() >= config.deadline_seconds
    if job is not None and job.state == "Succeeded":
        return _succeeded(base, job, artifact, key)
    if job is not None and job.state == "Failed":
        why = _last_line(job.message) or "the capture Job failed"
        status = base.model_copy(update={"phase": "Failed", "reason": why})
        message = f"capturing the engine cache {uri} failed: {why}; the pods compile as before"
        return EngineCacheStep(status, ("False", "CaptureFailed", message), roll=True)
    if late:
        why = f"not captured within spec.engineCache.deadlineSeconds ({config.deadline_seconds} s)"
        status = base.model_copy(update={"phase": "DeadlinePassed", "reason": why})
        message = f"engine cache {uri}: {why}: rolled without it; the pods compile as before"
        return EngineCacheStep(status, ("False", "DeadlinePassed", message), roll=True)
    follow = f" (follow: kubectl logs -f job/{job.name})" if job is not None and job.name else ""
    message = f"capturing the engine cache {uri} before the roll{follow}"
    return EngineCacheStep(base, ("False", "Capturing", message), roll=False,
                           create=planned if job is None else None)  # fmt: skip


def _succeeded(
    base: EngineCacheStatus, job: JobObservation, artifact: Artifact, key: str
) -> EngineCacheStep:
    captured = parse_capture(job.message)
    if captured is None:
        why = "the capture Job reported no summary with the serving configuration"
        status = base.model_copy(update={"phase": "Failed", "reason": why})
        return EngineCacheStep(status, ("False", "CaptureFailed", f"{base.uri}: {why}"), True)
    size = f"{captured.get('files', 0)} files, {int(captured.get('bytes', 0)) / 1e6:.1f} MB"
    status = base.model_copy(update={
        "phase": "Captured",
        "reason": f"captured ({size})",
        "config": json.dumps(captured["config"], sort_keys=True, separators=(",", ":")),
        "hardware": json.dumps(captured["hardware"], sort_keys=True, separators=(",", ":")),
    })  # fmt: skip
    return _captured(status, artifact, key)


def _captured(status: EngineCacheStatus, artifact: Artifact, key: str) -> EngineCacheStep:
    assert status.config is not None
    hardware = json.loads(status.hardware) if status.hardware else {}
    use = EngineCacheUse(
        path=cache_path(artifact, key),
        uri=status.uri,
        config=status.config,
        hardware=status.hardware if hardware.get("kind") == "gpu" else None,
        env=tuple(sorted(CAPTURE_DEFAULT_ENV.items())),
    )
    message = f"engine cache {status.uri} {status.reason}: the pods are given it"
    return EngineCacheStep(status, ("True", "Captured", message), roll=True, use=use)


def _last_line(message: str) -> str:
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""
