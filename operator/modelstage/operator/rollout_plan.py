"""``spec + artifact + workload -> JSON merge patch`` of the workload's pod templates.

The plan edits a copy of each pod template (docs/architecture.md, the serving side: vLLM args,
``MODELSTAGE_*`` and S3 env, the artifact volume, the ``modelstage prepare`` initContainer
with its plugin ``emptyDir`` on ``PYTHONPATH``, the digest annotation) and returns the merge
patch from the current workload to that. Items the operator owns are named ``modelstage-*``
and replaced in place, so planning against the patched workload yields an empty patch, and
every container, volume, env var and argument the operator does not own is left alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from modelstage.api.modeldeployment import DEFAULT_STAGER_IMAGE, ModelDeploymentSpec, S3Connection
from modelstage.api.objects import DIGEST_ANNOTATION, KubeObject
from modelstage.core import node_cache as nc
from modelstage.core.engine_cache import ROOTS
from modelstage.core.errors import SpecError
from modelstage.core.formats import FORMATS, S3_READER_FORMAT
from modelstage.core.pipeline_parallel import PARTITION_ENV, spell_layer_partition

from .artifact import ARTIFACT_MOUNT, Artifact
from .kube import (
    ENGINE_CACHE_ANNOTATION,
    ENGINE_CACHE_DIR,
    MANAGED_ENV_ANNOTATION,
    OWNED_PREFIX,
    PLUGIN_DIR,
    TOKEN_DIR,
    VOLUME_ARTIFACTS,
    VOLUME_ENGINE_CACHE,
    VOLUME_NO_TOKEN,
    VOLUME_NODE_CACHE,
    VOLUME_PLUGINS,
    ca_file,
    ca_mount,
    ca_volume,
    container_security_context,
    s3_credentials_env,
)
from .patch import merge_diff
from .vllm_args import VllmSettings, rewrite, vllm_arguments
from .workload_kinds import Path, serving_path, serving_template, templates, with_templates

PREPARE_CONTAINER = "modelstage-prepare"
ACCELERATORS = ("nvidia.com/gpu", "amd.com/gpu")
RAY_MARKERS = ("ray start", "multi-node-serving.sh worker")
"""A worker container that joins the leader's Ray cluster (vLLM's multi-node recipe): it
runs vLLM's workers from the leader's command line, and has none of its own to rewrite."""


@dataclass(frozen=True)
class EngineCacheUse:
    """A captured engine cache the serving pods are given (``engine_cache_plan``): prepare
    verifies it and places it in the ``emptyDir`` the vLLM container's cache roots point at."""

    path: str
    """Its folder in pods (on the artifact's PVC)."""
    uri: str
    config: str
    """The serving configuration (JSON) prepare checks the cache's key against."""
    hardware: str | None = None
    """The hardware class (JSON) when prepare cannot measure it (a GPU)."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables the capture ran with by default: the vLLM container gets those it does not
    set itself (they are in vLLM's key)."""


@dataclass(frozen=True)
class RolloutPlan:
    """What to send, and why. ``merge_patch`` is ``{}`` when the workload is already there."""

    merge_patch: KubeObject
    template: KubeObject
    """The pod template after the patch."""
    resource_version: str | None
    """The workload version planned against: send it as a precondition (409 when stale)."""
    details: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return bool(self.merge_patch)


def select_container(spec: ModelDeploymentSpec, pod_spec: KubeObject) -> KubeObject:
    """The vLLM container; ``SpecError`` naming the choices when it cannot be told."""
    containers: list[KubeObject] = pod_spec.get("containers") or []
    names = ", ".join(c.get("name", "?") for c in containers) or "none"
    wanted = spec.serving.container_name
    if wanted is None:
        if len(containers) == 1:
            return containers[0]
        raise SpecError(
            f"the pod has containers {names}: set spec.serving.containerName to the vLLM one"
        )
    for container in containers:
        if container.get("name") == wanted:
            return container
    raise SpecError(
        f"container {wanted!r} is not in the pod (containers: {names}): "
        "fix spec.serving.containerName"
    )


def vllm_settings(
    artifact: Artifact, plugin: bool, own_models: tuple[str, ...] = ()
) -> VllmSettings:
    fmt = FORMATS[artifact.load_format]
    # With the plugin on, MODELSTAGE_S3_READER (see _modelstage_env) has the plugin take over
    # the per-rank S3 format's stock loader.
    load_format = fmt.vllm_load_format(plugin=plugin, local=artifact.location.on_pvc)
    return VllmSettings(
        model=artifact.location.path,
        load_format=load_format,
        tensor_parallel_size=artifact.tp,
        pipeline_parallel_size=artifact.pp,
        extra_config=fmt.vllm_loader_config(artifact.location.path),
        kept_extra_keys=fmt.extra_config_keys,
        own_models=(f"{ARTIFACT_MOUNT}/", *own_models),
    )


def _s3_serving_env(artifact: Artifact, connection: S3Connection | None) -> list[KubeObject]:
    """What vLLM's S3 readers (Run:ai streamer, boto3, tensorizer) need, by reference."""
    if artifact.location.on_pvc:
        return []
    conn = connection or S3Connection()
    env: list[KubeObject] = []
    if conn.endpoint:
        env += [
            {"name": "AWS_ENDPOINT_URL", "value": conn.endpoint},
            {"name": "RUNAI_STREAMER_S3_ENDPOINT", "value": conn.endpoint},
        ]
    if not conn.virtual_addressing:
        env.append({"name": "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "value": "0"})
    if conn.region:
        env.append({"name": "AWS_REGION", "value": conn.region})
    ca = ca_file(conn)
    if ca:
        env.append({"name": "AWS_CA_BUNDLE", "value": ca})
    env += s3_credentials_env(conn.credentials_secret)
    given = {e["name"]: e for e in env}
    for name, copied in FORMATS[artifact.load_format].s3_serving_env:
        if copied.value in given:  # a format's loader reading a setting under its own name
            env.append({**given[copied.value], "name": name})
    return env


def _modelstage_env(artifact: Artifact, plugin: bool) -> list[KubeObject]:
    env = [
        {"name": "MODELSTAGE_DIGEST", "value": artifact.digest},
        {"name": "MODELSTAGE_FORMAT", "value": artifact.load_format},
        {"name": "MODELSTAGE_TP", "value": str(artifact.tp)},
        {"name": "MODELSTAGE_ARTIFACT", "value": artifact.location.path},
        *partition_env(artifact),
    ]
    if plugin and not artifact.location.on_pvc and artifact.load_format == S3_READER_FORMAT:
        # The plugin's S3 reader takes over vLLM's runai_streamer_sharded name: the same
        # checks as on a PVC, and ranged GETs at a fraction of the Run:ai streamer's CPU.
        env.append({"name": "MODELSTAGE_S3_READER", "value": "1"})
    return env


def partition_env(artifact: Artifact) -> list[KubeObject]:
    """The artifact's layer partition for vLLM (which splits the layers by it): the operator
    owns the variable on the container then, and removes it for an artifact without one."""
    if artifact.pp_partition is None:
        return []
    return [{"name": PARTITION_ENV, "value": spell_layer_partition(artifact.pp_partition)}]


def _upsert(
    items: list[KubeObject], wanted: Iterable[KubeObject], owned: Callable[[str], bool]
) -> list[KubeObject]:
    """Replace owned items in place, drop owned items no longer wanted, append new ones."""
    by_name = {w["name"]: w for w in wanted}
    out: list[KubeObject] = []
    for item in items:
        name = item.get("name", "")
        if name in by_name:
            out.append(by_name.pop(name))
        elif not owned(name):
            out.append(item)
    return out + list(by_name.values())


def _owned_name(name: str) -> bool:
    return name.startswith(OWNED_PREFIX)


def _python_path(env: list[KubeObject], plugin: bool) -> list[KubeObject]:
    """Prepend (or remove) the plugin folder on PYTHONPATH, keeping the user's entries."""
    current = next((e for e in env if e.get("name") == "PYTHONPATH"), None)
    entries = [p for p in str((current or {}).get("value", "")).split(":") if p and p != PLUGIN_DIR]
    if plugin:
        entries.insert(0, PLUGIN_DIR)
    rest = [e for e in env if e.get("name") != "PYTHONPATH"]
    if not entries:
        return rest
    value = {"name": "PYTHONPATH", "value": ":".join(entries)}
    if current is None:
        return [*rest, value]
    return [value if e.get("name") == "PYTHONPATH" else e for e in env]


def _prepare_container(
    artifact: Artifact,
    image: str,
    s3_env: list[KubeObject],
    connection: S3Connection | None,
    node_cache: bool = False,
    engine: EngineCacheUse | None = None,
) -> KubeObject:
    mounts: list[KubeObject] = [
        {"name": VOLUME_PLUGINS, "mountPath": PLUGIN_DIR},
        {"name": VOLUME_NO_TOKEN, "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    if artifact.location.on_pvc:
        mounts.append({"name": VOLUME_ARTIFACTS, "mountPath": ARTIFACT_MOUNT, "readOnly": True})
    if node_cache:
        mounts.append(_node_cache_mount())
    if engine is not None:
        mounts.append({"name": VOLUME_ENGINE_CACHE, "mountPath": ENGINE_CACHE_DIR})
    container: KubeObject = {
        "name": PREPARE_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [
            "modelstage",
            "prepare",
            "--artifact",
            artifact.location.path,
            "--digest",
            artifact.digest,
            "--tp",
            str(artifact.tp),
            *(["--pp", str(artifact.pp)] if artifact.pp > 1 else []),
            "--plugin-dir",
            PLUGIN_DIR,
            *(["--node-cache", nc.POD_MOUNT] if node_cache else []),
            *_engine_flags(engine),
        ],
        "volumeMounts": mounts + ca_mount(connection if not artifact.location.on_pvc else None),
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "securityContext": container_security_context(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if s3_env:
        container["env"] = s3_env
    return container


def _engine_flags(engine: EngineCacheUse | None) -> list[str]:
    """prepare's engine-cache flags: the cache, where to place it, this start's serving
    configuration, and the hardware class when prepare cannot see it."""
    if engine is None:
        return []
    flags = ["--engine-cache", engine.path, "--engine-cache-dir", ENGINE_CACHE_DIR,
             "--engine-config", engine.config]  # fmt: skip
    return flags + (["--engine-hardware", engine.hardware] if engine.hardware else [])


def plan_rollout(
    spec: ModelDeploymentSpec,
    artifact: Artifact,
    workload: KubeObject,
    *,
    default_image: str = DEFAULT_STAGER_IMAGE,
    node_cache_claim: str | None = None,
    engine_cache: EngineCacheUse | None = None,
) -> RolloutPlan:
    """The merge patch that puts ``workload`` on ``artifact``: every pod template of it
    (``workload_kinds``: a Deployment's or StatefulSet's one, a LeaderWorkerSet's leader and
    worker templates), in one patch; the workload's own rolling update rolls the pods.

    ``spec`` supplies the serving choices (container, plugin, image, S3 connection, node
    caching: the claim ``node_cache_claim`` of the artifact's node-local copy mounted
    read-only, its reader group added; None: no node-cache volume, e.g. no copy by the
    deadline); ``artifact`` may be an older one (a rollback); ``engine_cache``: the captured
    engine cache prepare places (None: none). Raises
    ``SpecError`` when the container or its vLLM command cannot be found (``validation``
    reports the same as a condition first).
    """
    new: dict[Path, KubeObject] = {}
    load_format = ""
    for i, (path, current) in enumerate(templates(workload)):
        template: KubeObject = copy.deepcopy(current)
        settings = _roll_template(
            spec, artifact, template, serving=i == 0, default_image=default_image,
            node_cache_claim=node_cache_claim, engine_cache=engine_cache,
        )  # fmt: skip
        load_format = load_format or settings.load_format
        new[path] = template
    patch = merge_diff(workload, with_templates(workload, new))
    engine = engine_cache if spec.serving.plugin else None
    return RolloutPlan(
        merge_patch=patch,
        template=new[serving_path(workload)],
        resource_version=workload.get("metadata", {}).get("resourceVersion"),
        details=_rollout_details(workload, artifact, load_format, engine) if patch else (),
    )


def template_container(spec: ModelDeploymentSpec, pod: KubeObject, serving: bool) -> KubeObject:
    """The container of a template the roll edits: the serving template's vLLM container
    (``select_container``); in a worker template (a LeaderWorkerSet's) the container named
    ``spec.serving.containerName`` when it has one, else its only container."""
    if serving:
        return select_container(spec, pod)
    containers: list[KubeObject] = pod.get("containers") or []
    named = [c for c in containers if c.get("name") == spec.serving.container_name]
    if named:
        return named[0]
    if len(containers) == 1:
        return containers[0]
    names = ", ".join(c.get("name", "?") for c in containers) or "none"
    raise SpecError(
        f"the worker template has containers {names}: name its vLLM or Ray container "
        "like the leader's (spec.serving.containerName)"
    )


def runs_vllm(container: KubeObject, serving: bool) -> bool:
    """Whether the container's command line is vLLM's (its arguments are rewritten): always
    for the serving container; a worker's may be vLLM's (``vllm serve ... --headless``) or a
    Ray node's (``ray start --address=...``, which gets all but the argument rewrite).
    ``SpecError`` when it is neither."""
    command, args = container.get("command"), container.get("args")
    try:
        vllm_arguments(command, args)
        return True
    except SpecError:
        line = " ".join([*(command or []), *(args or [])])
        if not serving and any(marker in line for marker in RAY_MARKERS):
            return False
        raise


def _roll_template(
    spec: ModelDeploymentSpec,
    artifact: Artifact,
    template: KubeObject,
    *,
    serving: bool,
    default_image: str,
    node_cache_claim: str | None,
    engine_cache: EngineCacheUse | None,
) -> VllmSettings:
    """Edits one pod template in place onto ``artifact``."""
    pod: KubeObject = template.setdefault("spec", {})
    annotations: dict[str, str] = template.setdefault("metadata", {}).setdefault("annotations", {})
    container = template_container(spec, pod, serving)
    connection = spec.storage.s3 if not artifact.location.on_pvc else None
    cache_claim = node_cache_claim if spec.node_cache.enabled and spec.serving.plugin else None
    engine = engine_cache if spec.serving.plugin else None
    settings = _serve_artifact(
        container, annotations, artifact, spec.serving.plugin, connection, cache_claim is not None,
        engine, rewrite_args=runs_vllm(container, serving),
    )  # fmt: skip
    _mount_artifact(pod, container, artifact, spec.serving.plugin, connection, cache_claim, engine)
    _drop_preference(pod)
    if cache_claim is not None:
        _add_reader_group(pod)
    prepare = (
        [
            _prepare_container(
                artifact,
                spec.stager.image or default_image,
                _s3_serving_env(artifact, connection),
                connection,
                cache_claim is not None,
                engine,
            )
        ]
        if spec.serving.plugin
        else []
    )
    pod["initContainers"] = _upsert(pod.get("initContainers") or [], prepare, _owned_name)
    _drop_empty(pod, container)
    return settings


def _drop_empty(pod: KubeObject, container: KubeObject) -> None:
    """Remove the lists the patch left empty (an empty list would be written as such)."""
    for key in ("initContainers", "volumes"):
        if not pod[key]:
            del pod[key]
    for key in ("volumeMounts", "env"):
        if not container[key]:
            del container[key]


def _rollout_details(
    workload: KubeObject, artifact: Artifact, load_format: str, engine: EngineCacheUse | None
) -> tuple[str, ...]:
    """The plan's one line for the log: which workload moves from which artifact to which,
    with which engine cache."""
    old_digest = (
        (serving_template(workload).get("metadata") or {})
        .get("annotations", {})
        .get(DIGEST_ANNOTATION)
    )
    cache = f", engine cache {engine.uri}" if engine is not None else ", no engine cache"
    return (
        f"{workload.get('kind', 'workload')} {workload.get('metadata', {}).get('name')}: "
        f"artifact {old_digest or 'none'} -> {artifact.digest} "
        f"({load_format}, TP {artifact.tp}{cache})",
    )


def _serve_artifact(
    container: KubeObject,
    annotations: dict[str, str],
    artifact: Artifact,
    plugin: bool,
    connection: S3Connection | None,
    node_cache: bool = False,
    engine: EngineCacheUse | None = None,
    *,
    rewrite_args: bool = True,
) -> VllmSettings:
    """Point the vLLM container's command (unless ``rewrite_args`` is off: a Ray node's) and
    environment at ``artifact`` (and its caches' roots at the engine cache's folder)."""
    # The artifact the container is on now (if any) is ours, not a model name clients use.
    previous = [
        e.get("value", "")
        for e in container.get("env") or []
        if e.get("name") == "MODELSTAGE_ARTIFACT"
    ]
    settings = vllm_settings(artifact, plugin, tuple(p for p in previous if p))
    if rewrite_args:
        command, args = rewrite(container.get("command"), container.get("args"), settings)
        for key, value in (("command", command), ("args", args)):
            if value is not None:
                container[key] = value
            else:
                container.pop(key, None)
    managed_env = _modelstage_env(artifact, plugin) + _s3_serving_env(artifact, connection)
    if node_cache:
        managed_env.append({"name": nc.ENV_NODE_CACHE, "value": nc.POD_MOUNT})
    previously = set(filter(None, annotations.get(MANAGED_ENV_ANNOTATION, "").split(",")))
    managed_env += _engine_env(container, engine, previously) + _ready_env(container, plugin)
    env = _upsert(
        container.get("env") or [],
        managed_env,
        lambda name: name in previously or name.startswith("MODELSTAGE_"),
    )
    container["env"] = _python_path(env, plugin)
    annotations[MANAGED_ENV_ANNOTATION] = ",".join(sorted(e["name"] for e in managed_env))
    annotations[DIGEST_ANNOTATION] = artifact.digest
    if engine is not None:
        annotations[ENGINE_CACHE_ANNOTATION] = engine.uri
    else:
        annotations.pop(ENGINE_CACHE_ANNOTATION, None)
    return settings


def _engine_env(
    container: KubeObject, engine: EngineCacheUse | None, managed: set[str]
) -> list[KubeObject]:
    """The cache roots in the engine cache's folder, and the capture's defaults the user
    does not set (``managed``: the names the operator set before)."""
    if engine is None:
        return []
    own = {e.get("name") for e in container.get("env") or []} - managed
    env = [{"name": var, "value": f"{ENGINE_CACHE_DIR}/{name}"} for name, var in ROOTS.items()]
    return env + [{"name": n, "value": v} for n, v in engine.env if n not in own]


def _ready_env(container: KubeObject, plugin: bool) -> list[KubeObject]:
    """``MODELSTAGE_READY_URL``: the readiness probe's URL, which the plugin polls for the
    start-up timeline's time to ready (``plugin/metrics.py``); only for an HTTP probe."""
    probe = (container.get("readinessProbe") or {}).get("httpGet")
    if not plugin or not isinstance(probe, dict):
        return []
    port = probe.get("port")
    if isinstance(port, str) and not port.isdigit():
        named = [p for p in container.get("ports") or [] if p.get("name") == port]
        port = named[0].get("containerPort") if named else None
    if port is None:
        return []
    scheme = str(probe.get("scheme") or "HTTP").lower()
    path = str(probe.get("path") or "/")
    url = f"{scheme}://127.0.0.1:{port}{path if path.startswith('/') else '/' + path}"
    return [{"name": "MODELSTAGE_READY_URL", "value": url}]


def _mount_artifact(
    pod: KubeObject,
    container: KubeObject,
    artifact: Artifact,
    plugin: bool,
    connection: S3Connection | None,
    node_cache_claim: str | None = None,
    engine: EngineCacheUse | None = None,
) -> None:
    """The artifact's claim, the plugin's folder, the CA bundle, the node-local copy's claim
    (read-only) and the engine cache's folder (written by vLLM), as volumes and mounts."""
    volumes: list[KubeObject] = []
    mounts: list[KubeObject] = []
    if artifact.location.on_pvc:
        claim = {"claimName": artifact.location.claim_name, "readOnly": True}
        volumes.append({"name": VOLUME_ARTIFACTS, "persistentVolumeClaim": claim})
        mounts.append({"name": VOLUME_ARTIFACTS, "mountPath": ARTIFACT_MOUNT, "readOnly": True})
    if plugin:
        volumes.append({"name": VOLUME_PLUGINS, "emptyDir": {}})
        # Shadows the service-account token in the initContainer (see kube.TOKEN_DIR).
        volumes.append({"name": VOLUME_NO_TOKEN, "emptyDir": {"sizeLimit": "1Mi"}})
        mounts.append({"name": VOLUME_PLUGINS, "mountPath": PLUGIN_DIR, "readOnly": True})
    volumes += ca_volume(connection)
    mounts += ca_mount(connection)
    if node_cache_claim is not None:
        claim = {"claimName": node_cache_claim, "readOnly": True}
        volumes.append({"name": VOLUME_NODE_CACHE, "persistentVolumeClaim": claim})
        mounts.append(_node_cache_mount())
    if engine is not None:
        volumes.append({"name": VOLUME_ENGINE_CACHE, "emptyDir": {}})
        mounts.append({"name": VOLUME_ENGINE_CACHE, "mountPath": ENGINE_CACHE_DIR})
    container["volumeMounts"] = _upsert(container.get("volumeMounts") or [], mounts, _owned_name)
    pod["volumes"] = _upsert(pod.get("volumes") or [], volumes, _owned_name)


def _add_reader_group(pod: KubeObject) -> None:
    """Copies are 0440/0550 owned by the agent's group: the pod reads its copy as a member."""
    context: KubeObject = pod.get("securityContext") or {}
    groups = [int(g) for g in context.get("supplementalGroups") or []]
    if nc.CACHE_GID not in groups:
        context["supplementalGroups"] = [*groups, nc.CACHE_GID]
    pod["securityContext"] = context


def _node_cache_mount() -> KubeObject:
    return {"name": VOLUME_NODE_CACHE, "mountPath": nc.POD_MOUNT, "readOnly": True}


def _ours(term: KubeObject) -> bool:
    """A preferred scheduling term of ours: it asks for a node cache label."""
    expressions = (term.get("preference") or {}).get("matchExpressions") or []
    return any(str(e.get("key", "")).startswith(nc.LABEL_PREFIX) for e in expressions)


def _drop_preference(pod: KubeObject) -> None:
    """Removes a preferred scheduling term of ours for a node cache label (the node-cache
    PV's node affinity places the pods now); the user's own terms stay as they are."""
    affinity: KubeObject = pod.get("affinity") or {}
    node_affinity: KubeObject = affinity.get("nodeAffinity") or {}
    preferred = "preferredDuringSchedulingIgnoredDuringExecution"
    terms: list[KubeObject] = node_affinity.get(preferred) or []
    if not any(_ours(t) for t in terms):
        return
    out = [t for t in terms if not _ours(t)]
    if out:
        node_affinity[preferred] = out
    else:
        node_affinity.pop(preferred, None)
    if node_affinity:
        affinity["nodeAffinity"] = node_affinity
    else:
        affinity.pop("nodeAffinity", None)
    if affinity:
        pod["affinity"] = affinity
    else:
        pod.pop("affinity", None)
