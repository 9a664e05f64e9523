"""The operator's configuration: environment variables in, kopf settings out.

Everything tunable is read once, here, from ``MODELSTAGE_OPERATOR_*`` variables (the chart and
the tests set them); ``configure`` applies it to kopf's settings in the one startup handler.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

import kopf
from modelstage.api.modeldeployment import DEFAULT_STAGER_IMAGE, GROUP
from modelstage.core.node_cache import DEFAULT_ROOT

PREFIX = "MODELSTAGE_OPERATOR_"
NODE_CACHE_ROOT_ENV = "MODELSTAGE_NODE_CACHE_ROOT"
"""The nodes' cache root on the host: one name for the operator and the chart's node agent."""
FINALIZER = f"{GROUP}/finalizer"
PEERING_NAME = "modelstage"
"""kopf's peering object: a second operator instance pauses instead of fighting."""
REPORTING_COMPONENT = "modelstage-operator"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    """A whole number: values that reach the API server as query parameters (``timeoutSeconds``)
    must be integers there, which it parses with ``strconv.ParseInt`` (``300.0`` is a 400)."""
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={raw!r} is not a whole number") from None


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{PREFIX}{name}={raw!r} is not a number") from None


def match_namespace(name: str, pattern: str) -> bool:
    """``name`` against one ``--namespace`` pattern as kopf reads it: comma-separated globs,
    ``!`` excluding; a pattern that starts with an exclusion starts from ``*``; a later
    inclusive glob re-includes only what the first one matched."""
    globs = [g.strip() for g in pattern.split(",")]
    if globs[0].startswith("!"):
        globs.insert(0, "*")
    matches = first = fnmatch.fnmatch(name, globs[0])
    for glob in globs[1:]:
        if glob.startswith("!"):
            matches = matches and not fnmatch.fnmatch(name, glob.lstrip("!"))
        else:
            matches = matches or (first and fnmatch.fnmatch(name, glob))
    return matches


@dataclass(frozen=True)
class OperatorConfig:
    metrics_port: int = 8080
    """Prometheus metrics on ``<metrics_host>:<port>``; 0 turns them off."""
    metrics_host: str = "127.0.0.1"
    """The address the metrics endpoint binds: loopback unless told otherwise (the chart
    binds the pod's IP, which Prometheus scrapes and a NetworkPolicy guards)."""
    stager_image: str = DEFAULT_STAGER_IMAGE
    """The stager image when a spec does not name one (also the serving initContainer's)."""
    allowed_stager_images: tuple[str, ...] = ()
    """Images a spec may name in ``spec.stager.image`` besides ``stager_image``: exact
    references, or repositories (any tag or digest of theirs). The image runs in stager Jobs
    and as an initContainer in the target workload's pods, whose loader plugin folder it
    fills: it is the operator's choice, not the ModelDeployment author's."""
    watch_server_timeout: int = 300
    """Seconds the API server keeps a watch open before the operator re-lists; sent as the
    watch's ``timeoutSeconds``, which the API server accepts only as an integer."""
    watch_client_timeout: float = 330.0
    connect_timeout: float = 10.0
    request_timeout: float = 30.0
    """Timeout of the handlers' own API requests."""
    resync_interval: float = 60.0
    """A timer re-reads every ModelDeployment this often: a safety net for missed events."""
    failed_backoff: float = 30.0
    """First retry delay after a failed staging Job; doubles per retry up to the maximum."""
    failed_backoff_max: float = 600.0
    conflict_delay: float = 1.0
    """Retry delay after a write hit a stale resourceVersion (HTTP 409)."""
    peering_lifetime: float = 60.0
    """Seconds an instance's peering record stays valid without a keep-alive: how long a
    paused instance waits before it takes over from one that died without saying so."""
    resolve_interval: float = 0.0
    """Seconds between resolutions of a moving source (a branch, an S3 prefix, a folder) when
    a spec sets no ``model.resolveIntervalSeconds``; 0: only when the spec changes."""
    stager_logs: bool = False
    """Read the tail of running stager pods' logs for their progress line (the ``Staged``
    condition shows it); needs ``get`` on ``pods/log``, which the chart grants only then."""
    max_stager_jobs: int = 4
    """Stage Jobs at once across everything this operator serves; more wait in a queue
    (``slots.py``); 0: no limit."""
    max_stager_jobs_per_namespace: int = 2
    """Stage Jobs at once per namespace, so that one namespace cannot take every slot;
    0: no cap beyond ``max_stager_jobs``."""
    posting_level: int = logging.INFO
    """Least severity of kopf's own messages posted as Kubernetes Events."""
    node_cache_root: str = DEFAULT_ROOT
    """The node-local cache root on the hosts (``spec.nodeCache``): the node agents'
    ``--root``; a node-cache PV's local path is a copy's directory under it."""
    node_cache: bool = False
    """Node caching is installed (chart ``nodeCache.enabled``): only then does the operator
    watch NodeCaches, Nodes and its PVs (a namespaced operator without it has no right to)."""
    copy_deadline_seconds: int = 3600
    """A copy Job's ``activeDeadlineSeconds``."""
    watched_namespaces: tuple[str, ...] | None = None
    """The ``--namespace`` patterns this operator serves (kopf's syntax); None: every
    namespace (``--all-namespaces``). Set from the command line, not the environment."""

    def watches(self, namespace: str) -> bool:
        """Whether ``namespace`` is one this operator serves: only there may it read claims
        (a namespaced operator's Role grants nothing elsewhere)."""
        if self.watched_namespaces is None:
            return True
        return any(match_namespace(namespace, p) for p in self.watched_namespaces)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        level_name = env.get(PREFIX + "POSTING_LEVEL", "INFO").upper()
        level = logging.getLevelName(level_name)
        if not isinstance(level, int):
            raise ValueError(f"{PREFIX}POSTING_LEVEL={level_name!r} is not a log level")
        return cls(
            metrics_port=_int(env, "METRICS_PORT", cls.metrics_port),
            metrics_host=env.get(PREFIX + "METRICS_HOST", cls.metrics_host),
            stager_image=env.get(PREFIX + "STAGER_IMAGE", cls.stager_image),
            allowed_stager_images=tuple(
                i.strip()
                for i in env.get(PREFIX + "ALLOWED_STAGER_IMAGES", "").split(",")
                if i.strip()
            ),
            watch_server_timeout=_int(env, "WATCH_SERVER_TIMEOUT", cls.watch_server_timeout),
            watch_client_timeout=_float(env, "WATCH_CLIENT_TIMEOUT", cls.watch_client_timeout),
            connect_timeout=_float(env, "CONNECT_TIMEOUT", cls.connect_timeout),
            request_timeout=_float(env, "REQUEST_TIMEOUT", cls.request_timeout),
            resync_interval=_float(env, "RESYNC_INTERVAL", cls.resync_interval),
            failed_backoff=_float(env, "FAILED_BACKOFF", cls.failed_backoff),
            failed_backoff_max=_float(env, "FAILED_BACKOFF_MAX", cls.failed_backoff_max),
            conflict_delay=_float(env, "CONFLICT_DELAY", cls.conflict_delay),
            max_stager_jobs=_int(env, "MAX_STAGER_JOBS", cls.max_stager_jobs),
            max_stager_jobs_per_namespace=_int(
                env, "MAX_STAGER_JOBS_PER_NAMESPACE", cls.max_stager_jobs_per_namespace
            ),
            resolve_interval=_float(env, "RESOLVE_INTERVAL", cls.resolve_interval),
            stager_logs=_flag(env, "STAGER_LOGS"),
            peering_lifetime=_float(env, "PEERING_LIFETIME", cls.peering_lifetime),
            posting_level=level,
            node_cache_root=_root(env.get(NODE_CACHE_ROOT_ENV) or cls.node_cache_root),
            node_cache=_flag(env, "NODE_CACHE"),
            copy_deadline_seconds=_int(
                env, "NODE_CACHE_COPY_DEADLINE_SECONDS", cls.copy_deadline_seconds
            ),
        )

    @property
    def stager_images(self) -> tuple[str, ...]:
        """Every image a spec may name: the default, then the allowed ones."""
        return (self.stager_image, *self.allowed_stager_images)

    def backoff(self, retry: int) -> float:
        """Delay before retry number ``retry`` (0-based) of a failed staging."""
        return float(min(self.failed_backoff * 2 ** min(retry, 30), self.failed_backoff_max))


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(PREFIX + name, "").strip().lower() in ("1", "true", "yes", "on")


def _root(raw: str) -> str:
    """An absolute, normalized host path other than ``/``: it becomes a hostPath volume."""
    path = posixpath.normpath(raw)
    if not raw.startswith("/") or path == "/" or path != raw.rstrip("/"):
        raise ValueError(
            f"{NODE_CACHE_ROOT_ENV}={raw!r} is not an absolute, normalized path below /"
        )
    return path


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """kopf's settings for this operator; called once from the startup handler."""
    settings.posting.level = config.posting_level
    settings.posting.reporting_component = REPORTING_COMPONENT
    settings.posting.reporting_instance = os.environ.get("HOSTNAME", "local")
    settings.watching.server_timeout = int(config.watch_server_timeout)
    settings.watching.client_timeout = config.watch_client_timeout
    settings.watching.connect_timeout = config.connect_timeout
    settings.networking.request_timeout = config.request_timeout
    settings.peering.name = PEERING_NAME
    settings.peering.mandatory = False
    settings.peering.lifetime = max(1, int(config.peering_lifetime))
    settings.persistence.finalizer = FINALIZER
    # kopf's bookkeeping in annotations named after us, not in our status schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
