"""The ModelDeployment API (``modelstage.io/v1alpha1``): spec and status as pydantic models.

The models are the single source of the API: the CRD in ``crds/`` is generated from them
(``python -P -m modelstage.api.crd``), and the operator parses what the API server hands it
with them. Cross-field rules live in one table per model (``Rule``): each has a CEL expression
that the API server enforces and a Python predicate that ``model_validator`` enforces, so a
spec the CRD refuses is refused here too (tests pin the two against each other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Literal

from modelstage.core.formats import AUTO, FORMATS
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

GROUP = "modelstage.io"
VERSION = "v1alpha1"
KIND: Final = "ModelDeployment"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
SHORT_NAMES = ("md", "mdep")
API_VERSION: Final = "modelstage.io/v1alpha1"

DEFAULT_STAGER_IMAGE = "ghcr.io/modelstage/stager:0.1.0"
"""The stager image when ``spec.stager.image`` is unset; the operator may override it."""

if TYPE_CHECKING:  # the checker sees a str; pydantic, the CRD and the API server the list
    LoadFormat = str
    SpecLoadFormat = str
else:
    LoadFormat = Literal[tuple(FORMATS)]
    SpecLoadFormat = Literal[(AUTO, *FORMATS)]
"""``LoadFormat``: the format table's names (``modelstage.core.formats``), in its order.
``SpecLoadFormat`` (``spec.loadFormat``): a format, or ``auto`` (``choose_format``: per rank
where the stager splits the checkpoint's architecture, the Hugging Face layout otherwise)."""
S3_ONLY_FORMATS = sorted(f.name for f in FORMATS.values() if f.storage == ("s3",))
PVC_ONLY_FORMATS = sorted(f.name for f in FORMATS.values() if f.storage == ("pvc",))


def _storing(kind: str) -> list[str]:
    """The formats a ModelDeployment may keep on ``kind`` of storage."""
    return sorted(f.name for f in FORMATS.values() if kind in f.storage)


def _same_files_on(kind: str, names: list[str]) -> list[str]:
    """The formats of the same files as ``names`` that ``kind`` of storage may keep."""
    files = {FORMATS[n].weight_files.pattern for n in names}
    return sorted(
        f.name for f in FORMATS.values() if kind in f.storage and f.weight_files.pattern in files
    )


def _format_not_in(names: list[str]) -> str:
    """CEL: ``spec.loadFormat`` is none of ``names``."""
    if len(names) == 1:
        return f"self.loadFormat != '{names[0]}'"
    return f"!(self.loadFormat in {names})"


Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Phase = Literal["Pending", "Staging", "Staged", "RollingOut", "Ready", "Failed"]
ConditionType = Literal["Staged", "Ready", "Degraded", "NodeCached", "EngineCached"]

# Patterns are ECMA-262 and Python compatible (the API server evaluates them, so does pydantic).
DNS_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MODEL_URI = r"^(hf://[A-Za-z0-9][\w.-]*/[\w.-]+/?|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?)$"
S3_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$"
SAFE_PATH = r"^[A-Za-z0-9_./-]*$"
"""Plain path characters; ``..`` segments are refused by a rule."""

Quantity = Annotated[
    int | str,
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
        }
    ),
]
"""A Kubernetes resource quantity (``2``, ``500m``, ``16Gi``)."""

SecretName = Annotated[str, Field(pattern=DNS_NAME, max_length=253)]


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: CEL for the API server, the same predicate in Python for us."""

    cel: str
    message: str
    check: Callable[[Any], bool]


class Model(BaseModel):
    """Base: camelCase on the wire, unknown fields refused, no coercion (``"4"`` is not a TP:
    the API server would refuse it too), ``Rule`` tables enforced."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        frozen=True,
        strict=True,
    )
    rules: ClassVar[tuple[Rule, ...]] = ()

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """Attach the rules' CEL to the model's schema, where the CRD generator finds it."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        if cls.rules:
            schema["x-kubernetes-validations"] = [
                {"rule": rule.cel, "message": rule.message} for rule in cls.rules
            ]
        return schema

    @model_validator(mode="after")
    def _check_rules(self) -> Model:
        for rule in self.rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, unset fields omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class S3Connection(Model):
    """How to reach an S3-compatible store. Credentials come only from a Secret."""

    endpoint: Annotated[str, Field(pattern=r"^https?://[^\s]+$")] | None = None
    """Endpoint URL for S3-compatible servers (MinIO, SeaweedFS, Ceph); unset for AWS."""
    region: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    """Region (``AWS_REGION``); unset lets the SDK decide."""
    credentials_secret: SecretName | None = None
    """Secret with keys ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``; unset for
    workload identity (IRSA and similar)."""
    virtual_addressing: bool = False
    """Virtual-hosted-style URLs (``bucket.host``); false = path-style (most self-hosted stores)."""
    ca_bundle_secret: SecretName | None = None
    """Secret with key ``ca.crt``: the CA bundle that signs the endpoint's certificate."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            # Not a pattern: the API server would quote the refused value, credential and all.
            cel="!has(self.endpoint) || !self.endpoint.contains('@')",
            message="the S3 endpoint must not carry credentials (user:password@host): put "
            "them in the Secret named by credentialsSecret",
            check=lambda c: c.endpoint is None or "@" not in c.endpoint,
        ),
    )


class ModelSource(Model):
    """The checkpoint to stage."""

    uri: Annotated[str, Field(pattern=MODEL_URI, max_length=1024)]
    """``hf://org/name``, ``s3://bucket/prefix`` or ``pvc://claim/path``."""
    revision: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Hugging Face revision (branch, tag or commit); the stager records the resolved commit."""
    credentials_secret: SecretName | None = None
    """Secret with key ``HF_TOKEN`` (hf://) or ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``
    (s3:// with PVC storage)."""
    s3: S3Connection | None = None
    """Endpoint of an s3:// source when the artifact goes to a PVC (with S3 storage, the
    storage's connection serves the source too)."""
    size_hint: Quantity | None = None
    """The checkpoint's size (its weight files, e.g. ``140Gi``). The operator never reads
    the source; with this hint it sizes a claim it creates (``storage.pvc.create`` without
    ``size``) and refuses, before any Job starts, a claim too small for the artifacts."""
    resolve_interval_seconds: Annotated[int, Field(ge=0, le=30 * 24 * 3600)] | None = None
    """Resolve the source again this often (a branch's commit, the objects' ETags, the
    folder's files) and stage and roll out anew when it changed; 0: only when the spec
    changes; unset: the operator's default (``MODELSTAGE_OPERATOR_RESOLVE_INTERVAL``). A
    pinned commit never moves and is not resolved again."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!self.uri.matches('^[a-z0-9]+://.*/[.][.](/.*)?$')",
            message="model.uri must not contain '..' path segments",
            check=lambda m: ".." not in m.uri.split("://", 1)[-1].split("/"),
        ),
        Rule(
            cel="!has(self.revision) || self.uri.startsWith('hf://')",
            message="model.revision applies to hf:// sources only: remove it",
            check=lambda m: m.revision is None or m.uri.startswith("hf://"),
        ),
        Rule(
            cel="!has(self.s3) || self.uri.startsWith('s3://')",
            message="model.s3 applies to s3:// sources only: remove it",
            check=lambda m: m.s3 is None or m.uri.startswith("s3://"),
        ),
        Rule(
            cel="!has(self.s3) || !has(self.s3.credentialsSecret) || !has(self.credentialsSecret)",
            message="set the source's S3 credentials once: model.credentialsSecret or "
            "model.s3.credentialsSecret, not both",
            check=lambda m: (
                m.s3 is None or m.s3.credentials_secret is None or m.credentials_secret is None
            ),
        ),
        Rule(
            cel="!has(self.resolveIntervalSeconds) || self.resolveIntervalSeconds == 0 "
            "|| self.resolveIntervalSeconds >= 60",
            message="model.resolveIntervalSeconds is 0 (only on spec changes) or at least 60: "
            "each resolution is a Job",
            check=lambda m: not 0 < (m.resolve_interval_seconds or 0) < 60,
        ),
    )

    @property
    def scheme(self) -> Literal["hf", "s3", "pvc"]:
        scheme = self.uri.split("://", 1)[0]
        assert scheme in ("hf", "s3", "pvc")
        return scheme  # type: ignore[return-value]


class Parallelism(Model):
    """How vLLM splits the model; the artifact holds one set of files per rank."""

    tensor: Annotated[int, Field(ge=1, le=64)] = 1
    """Tensor-parallel size (``--tensor-parallel-size``)."""
    pipeline: Annotated[int, Field(ge=1, le=64)] = 1
    """Pipeline-parallel size (``--pipeline-parallel-size``): every stage's TP ranks get files
    of their own (per-rank formats but ``tensorizer``; vLLM 0.32); every pod runs all
    ``tensor`` x ``pipeline`` ranks."""
    layer_partition: (
        Annotated[
            list[Annotated[int, Field(ge=0, le=9999)]], Field(min_length=2, max_length=64)
        ]
        | None
    ) = None
    """Decoder layers per pipeline stage (``[14, 18]``: the first stage 14, the second 18),
    which vLLM reads as ``VLLM_PP_LAYER_PARTITION``; unset: vLLM's even split. Staged into the
    artifact (its digest) and set on the vLLM container, which the operator then owns."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.layerPartition) || size(self.layerPartition) == self.pipeline",
            message="parallelism.layerPartition gives one layer count per pipeline stage: as many "
            "counts as parallelism.pipeline",
            check=lambda p: p.layer_partition is None or len(p.layer_partition) == p.pipeline,
        ),
    )


class ClaimTemplate(Model):
    """A PVC for the operator to create when it does not exist."""

    storage_class_name: Annotated[str, Field(pattern=DNS_NAME, max_length=253)] | None = None
    size: Quantity | None = None
    """Capacity: room for the artifacts kept (``retention.keep``) of every ModelDeployment using
    the claim. Default: computed from ``model.sizeHint`` (see ``claim_plan.required_bytes``)."""
    access_modes: Annotated[
        list[Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]],
        Field(min_length=1, max_length=4),
    ] = ["ReadWriteMany"]


class PvcStorage(Model):
    """Artifacts on a PersistentVolumeClaim: ``<claim>/<path>/<namespace>/<digest>/``."""

    claim_name: Annotated[str, Field(pattern=DNS_NAME, max_length=253)] | None = None
    """An existing claim, or the name of the one to create (default ``modelstage-<name>``)."""
    path: Annotated[str, Field(pattern=SAFE_PATH, max_length=512)] = "/"
    """Folder inside the claim under which artifacts live."""
    create: ClaimTemplate | None = None
    """Create the claim if it does not exist."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.claimName) || has(self.create)",
            message="storage.pvc needs claimName (an existing claim) or create (a new one)",
            check=lambda p: p.claim_name is not None or p.create is not None,
        ),
        Rule(
            cel="!self.path.matches('(^|/)[.][.](/|$)')",
            message="storage.pvc.path must not contain '..'",
            check=lambda p: ".." not in p.path.split("/"),
        ),
    )


class S3Storage(S3Connection):
    """Artifacts under an S3 prefix: ``s3://bucket/prefix/<namespace>/<digest>/``."""

    uri: Annotated[str, Field(pattern=S3_URI, max_length=1024)]


class Storage(Model):
    """Where artifacts go: exactly one of ``pvc`` and ``s3``."""

    pvc: PvcStorage | None = None
    s3: S3Storage | None = None

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.pvc) != has(self.s3)",
            message="set exactly one of storage.pvc and storage.s3",
            check=lambda s: (s.pvc is None) != (s.s3 is None),
        ),
    )


class Toleration(Model):
    key: Annotated[str, Field(max_length=317)] | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: Annotated[str, Field(max_length=63)] | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(Model):
    """Container resources (requests and limits by resource name)."""

    requests: dict[str, Quantity] | None = None
    limits: dict[str, Quantity] | None = None


class Stager(Model):
    """How the staging Job runs."""

    image: Annotated[str, Field(min_length=1, max_length=512)] | None = None
    """Stager image, also run as the serving pods' initContainer; the operator's default when
    unset. Only images the operator allows are accepted (the chart's ``stagerImage`` and
    ``stagerImage.allowed``); any other is refused with reason ``StagerImageNotAllowed``."""
    resources: Resources | None = None
    workers: Annotated[int, Field(ge=1, le=64, alias="parallelism")] = 1
    """Pods of an Indexed Job, each writing a group of tensors (per-rank safetensors formats)."""
    node_selector: dict[str, str] | None = None
    tolerations: Annotated[list[Toleration], Field(max_length=32)] | None = None
    service_account_name: Annotated[str, Field(pattern=DNS_NAME, max_length=253)] | None = None
    """Service account of the stager pods, for workload identity (S3 through IRSA and the
    like); its Kubernetes API token is never mounted in them."""
    backoff_limit: Annotated[int, Field(ge=0, le=20)] = 2
    active_deadline_seconds: Annotated[int, Field(ge=60, le=7 * 24 * 3600)] = 6 * 3600
    """Give up staging after this long (a 70B checkpoint at 1 GB/s takes about 3 minutes)."""


class TargetRef(Model):
    """The vLLM workload whose pod templates the operator patches. It must opt in: its
    metadata carries the annotation ``modelstage.io/model-deployment`` naming this
    ModelDeployment; without it nothing is patched (reason ``TargetNotOptedIn``)."""

    kind: Literal["Deployment", "StatefulSet", "LeaderWorkerSet"] = "Deployment"
    """``LeaderWorkerSet`` (``leaderworkerset.x-k8s.io/v1``): multi-node serving, its leader
    and worker templates patched together (docs/api.md, "Multi-node serving")."""
    name: Annotated[str, Field(pattern=DNS_NAME, max_length=253)]


class Serving(Model):
    """How the staged artifact reaches vLLM."""

    target_ref: TargetRef
    container_name: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)] | None = None
    """The vLLM container; may be unset when the pod has one container."""
    vllm_version: Annotated[str, Field(pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$")] | None = None
    """The vLLM version the workload runs: it selects the per-rank layout to produce. Unset:
    the version in the tag of the vLLM container's image (``vllm/vllm-openai:v0.30.1`` is
    0.30), else the default, 0.32; ``status.vllmVersion`` says which and why."""
    plugin: bool = True
    """Inject the modelstage loader plugin (checks, metrics); false = stock vLLM loaders."""


class Retention(Model):
    """Which artifacts outlive their use. Artifacts are shared per namespace (content-
    addressed), so one is deleted only when no ModelDeployment of the namespace keeps or
    wants it."""

    keep: Annotated[int, Field(ge=1, le=10)] = 2
    """Artifacts kept per ModelDeployment (the current one and ones to roll back to); older
    ones are deleted by a clean-up Job."""
    on_delete: Literal["Delete", "Retain"] = "Delete"
    """When the ModelDeployment is deleted: ``Delete`` its artifacts (those no other
    ModelDeployment keeps), or ``Retain`` them all on the storage."""


class NodeCache(Model):
    """Copies of the staged artifact on the local disks (or RAM) of the nodes the workload can
    run on, made and verified by the node agent's copy Jobs before the roll
    (docs/api.md, "Node caching")."""

    enabled: bool = False
    nodes: Literal["Replicas", "All"] = "Replicas"
    """Which of the nodes the workload's pods may run on (its nodeSelector, required node
    affinity and tolerations, nodes with a node agent) get a copy: the replicas' worth, or all."""
    warm: bool = False
    """Read the copies into the nodes' page cache just before the roll."""
    deadline_seconds: Annotated[int, Field(ge=0, le=24 * 3600)] = 1800
    """How long after staging the roll waits for the copies; then it rolls anyway (pods on a
    node without a copy read the artifact from the PVC or S3) and the status says so."""


class EngineCapture(Model):
    """Where the capture Job runs: a node of the serving class. Unset fields take the vLLM
    container's resources and the workload pod's nodeSelector and tolerations."""

    resources: Resources | None = None
    node_selector: dict[str, str] | None = None
    """Also the hardware class the cache is keyed by: a changed selector captures again."""
    tolerations: Annotated[list[Toleration], Field(max_length=32)] | None = None


class EngineCache(Model):
    """vLLM's compile caches captured once per artifact, serving configuration and hardware
    class by a capture Job, and placed by the serving pods' prepare before vLLM starts
    (docs/api.md, "The engine cache")."""

    enabled: bool = False
    capture: EngineCapture = EngineCapture()
    deadline_seconds: Annotated[int, Field(ge=0, le=24 * 3600)] = 1800
    """How long after staging the roll waits for the capture; then it rolls without the cache
    (the pods compile as they would have) and the status says so. Also the capture Job's
    ``activeDeadlineSeconds`` (at least 60)."""


class ModelDeploymentSpec(Model):
    """What to stage and which vLLM workload to roll onto it."""

    model: ModelSource
    parallelism: Parallelism = Parallelism()
    dtype: Dtype = "auto"
    """Weights dtype of the artifact; ``auto`` keeps the checkpoint's."""
    load_format: SpecLoadFormat = "auto"
    """``auto``: chosen once the source is resolved, recorded in ``status.format``."""
    storage: Storage
    stager: Stager = Stager()
    serving: Serving
    retention: Retention = Retention()
    node_cache: NodeCache = NodeCache()
    engine_cache: EngineCache = EngineCache()

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel=f"{_format_not_in(S3_ONLY_FORMATS)} || has(self.storage.s3)",
            message=f"loadFormat {' and '.join(S3_ONLY_FORMATS)} stream from S3: set storage.s3, "
            f"or use {' or '.join(_storing('pvc'))} with storage.pvc",
            check=lambda s: s.load_format not in S3_ONLY_FORMATS or s.storage.s3 is not None,
        ),
        Rule(
            cel="!has(self.storage.pvc) || !has(self.storage.pvc.create) "
            "|| has(self.storage.pvc.create.size) || has(self.model.sizeHint)",
            message="storage.pvc.create needs a size, or model.sizeHint to compute it from",
            check=lambda s: (
                s.storage.pvc is None
                or s.storage.pvc.create is None
                or s.storage.pvc.create.size is not None
                or s.model.size_hint is not None
            ),
        ),
        Rule(
            cel=f"{_format_not_in(PVC_ONLY_FORMATS)} || has(self.storage.pvc)",
            message=f"loadFormat {' and '.join(PVC_ONLY_FORMATS)} read local files: set "
            f"storage.pvc, or use {' or '.join(_same_files_on('s3', PVC_ONLY_FORMATS))} with "
            "storage.s3",
            check=lambda s: s.load_format not in PVC_ONLY_FORMATS or s.storage.pvc is not None,
        ),
        Rule(
            cel="!has(self.model.s3) || !has(self.storage.s3)",
            message="the stager takes one S3 connection: with storage.s3 it also reads the "
            "s3:// source, so remove model.s3",
            check=lambda s: s.model.s3 is None or s.storage.s3 is None,
        ),
        Rule(
            cel="!has(self.serving.targetRef.kind) || self.serving.targetRef.kind != "
            "'LeaderWorkerSet' || !(has(self.nodeCache) && has(self.nodeCache.enabled) && "
            "self.nodeCache.enabled || has(self.engineCache) && has(self.engineCache.enabled) "
            "&& self.engineCache.enabled)",
            message="serving.targetRef.kind LeaderWorkerSet does not support node caching or "
            "the engine cache yet: set nodeCache.enabled and engineCache.enabled to false",
            check=lambda s: (
                s.serving.target_ref.kind != "LeaderWorkerSet"
                or not (s.node_cache.enabled or s.engine_cache.enabled)
            ),
        ),
        Rule(
            cel="!(self.model.uri.startsWith('s3://') && has(self.storage.s3) "
            "&& has(self.model.credentialsSecret))",
            message="the stager takes one set of S3 credentials: with storage.s3, "
            "storage.s3.credentialsSecret also reads the s3:// source, so remove "
            "model.credentialsSecret",
            check=lambda s: (
                not (
                    s.model.uri.startswith("s3://")
                    and s.storage.s3 is not None
                    and s.model.credentials_secret is not None
                )
            ),
        ),
    )


class SourceStatus(Model):
    """The source identity the desired artifact's digest is taken from, as last resolved."""

    model_config = ConfigDict(extra="ignore", strict=False)
    uri: str
    revision: str | None = None
    identity: str
    """``commit:<sha>`` (hf://), else ``sha256:`` over the objects' ETags or the files' sizes,
    header hashes and modification times (what ``modelstage resolve`` prints)."""
    commit: str | None = None
    """The commit the revision named (hf://)."""
    resolved_at: datetime
    key: str
    """The spec's source fields (URI, revision, endpoint) this identity was resolved for: a
    change of them resolves again."""
    job: str | None = None
    """The resolve Job that reported it; unset for a pinned commit (known from the spec)."""
    architecture: str | None = None
    """The architecture config.json names (``""``: none), when the resolve Job read it: what
    ``loadFormat: auto`` decides by."""
    quantization: str | None = None
    """config.json's quantization: ``compressed-tensors/w8a8-fp8-channel`` for the FP8 scheme
    staged per rank, else its ``quantization_config`` method; unset: unquantized."""


class FormatStatus(Model):
    """The format the spec's artifact is staged in, and why (``loadFormat: auto`` chooses)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    name: LoadFormat
    reason: str


class VllmVersionStatus(Model):
    """The vLLM version the artifact is staged for, and why: the spec's, the image tag's, or
    the default."""

    model_config = ConfigDict(extra="ignore", strict=False)
    version: str
    reason: str


class ArtifactStatus(Model):
    """A staged artifact, as the stager reported it."""

    model_config = ConfigDict(extra="ignore", strict=False)
    digest: str
    uri: str
    """``pvc://claim/path/namespace/digest`` or ``s3://bucket/prefix/namespace/digest``."""
    format: LoadFormat
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    layer_partition: tuple[int, ...] | None = None
    """Layers per pipeline stage it is staged for (``parallelism.layerPartition``)."""
    source: str | None = None
    """Source identity it was staged from (``commit:<sha>`` or ``sha256:<hex>``)."""
    bytes: int | None = None
    files: int | None = None
    staged_at: datetime | None = None
    stage_seconds: float | None = None


class NodeCopyStatus(Model):
    """One node's copy of the desired artifact, and what pods starting there found."""

    model_config = ConfigDict(extra="ignore", strict=False)
    name: str
    state: Literal["Pending", "Copying", "Ready", "Warm", "Failed"]
    message: str = ""
    hits: int = 0
    """Serving pods that started on this node and read the node-local copy."""
    misses: int = 0
    """Serving pods that started on this node and read the PVC or S3 instead."""


class NodeCacheStatus(Model):
    """Where the copies of the desired artifact stand (``spec.nodeCache.enabled``)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    digest: str
    phase: Literal["Copying", "Warming", "Ready", "DeadlinePassed"]
    wanted: int = 0
    """Nodes that should hold a copy."""
    ready: int = 0
    """Nodes holding a complete, verified copy."""
    since: datetime | None = None
    """When the copies were first asked for: the deadline counts from here."""
    nodes: list[NodeCopyStatus] = Field(default_factory=list)


class EngineCacheStatus(Model):
    """The engine cache of the desired artifact and serving configuration
    (``spec.engineCache.enabled``)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    digest: str
    """The weights artifact it belongs to."""
    key: str
    """The operator's capture key: the artifact digest, the vLLM image, the engine arguments,
    the compile environment and the capture's node selector (``engine_cache_plan``)."""
    uri: str
    """Where it is: beside the artifact, ``pvc://claim/path/namespace/<digest>.engine-<key>``."""
    phase: Literal["Capturing", "Captured", "Failed", "DeadlinePassed", "Unavailable"]
    reason: str = ""
    since: datetime | None = None
    """When the capture was first asked for: the deadline counts from here."""
    config: str | None = None
    """The serving configuration the capture ran with (JSON, as ``capture-engine-cache``
    reports it: vLLM and torch versions, engine arguments, environment): what the serving
    pods' prepare checks the cache's key against."""
    hardware: str | None = None
    """The hardware class the capture measured (JSON), given to prepare for GPUs (an
    initContainer sees no GPU)."""


class Condition(Model):
    """A Kubernetes-style condition; lastTransitionTime changes only when status changes."""

    model_config = ConfigDict(extra="ignore", strict=False)
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")]
    message: Annotated[str, Field(max_length=32768)] = ""
    last_transition_time: datetime
    observed_generation: int | None = None


class ModelDeploymentStatus(Model):
    """What the operator last observed and did. Unknown fields are kept (kopf's own state)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    phase: Phase = "Pending"
    reason: str | None = None
    """Why the phase is what it is, in one word: the reason of the condition that decides it
    (``Degraded`` when true, else ``Staged`` until staged, else ``Ready``)."""
    observed_generation: int | None = None
    desired_digest: str | None = None
    """The digest the current spec asks for (of the resolved source identity)."""
    source: SourceStatus | None = None
    """The source identity last resolved for the spec, and when."""
    format: FormatStatus | None = None
    """The format of the desired artifact and why: the spec's, or the one ``auto`` chose."""
    vllm_version: VllmVersionStatus | None = None
    """The vLLM version the desired artifact is staged for, and why."""
    artifact: ArtifactStatus | None = None
    """The artifact the workload is rolled (or rolling) onto."""
    previous_artifact: ArtifactStatus | None = None
    """The artifact served before the current rollout: the rollback target."""
    failed_digest: str | None = None
    """A digest whose rollout failed and was rolled back; not retried until the spec changes."""
    failure_reason: str | None = None
    """Why the pods on ``failed_digest`` failed (crash loop, image pull, ...), as observed when
    the rollback was decided: later reconciliations, which no longer see those pods, keep
    reporting it."""
    workload_generation: int | None = Field(default=None, ge=1)
    """The workload's generation when it was last seen on ``artifact``. Off the artifact at a
    later generation means someone else changed it: reported, never patched back."""
    queue_position: int | None = None
    """While staging waits for one of the operator's stager slots: the place in the queue
    (1 = next); see the ``Staged`` condition (reason ``Queued``)."""
    node_cache: NodeCacheStatus | None = None
    """Node-local copies of the desired artifact (``spec.nodeCache``)."""
    engine_cache: EngineCacheStatus | None = None
    """The engine cache of the desired artifact (``spec.engineCache``)."""
    artifacts: list[ArtifactStatus] = Field(default_factory=list)
    """Artifacts this ModelDeployment staged or used, most recently used first: what
    ``retention.keep`` counts and the clean-up deletes from."""
    conditions: list[Condition] = Field(default_factory=list)

    def condition(self, type_: ConditionType) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)


class ModelDeployment(Model):
    """A checkpoint staged per tensor-parallel rank ahead of time, and the vLLM workload that
    the operator rolls onto it."""

    model_config = ConfigDict(extra="ignore", strict=False)
    api_version: Literal["modelstage.io/v1alpha1"] = API_VERSION
    kind: Literal["ModelDeployment"] = KIND
    metadata: dict[str, Any]
    spec: ModelDeploymentSpec
    status: ModelDeploymentStatus | None = None
