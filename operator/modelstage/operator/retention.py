"""``statuses of a namespace -> artifacts to delete``: retention with shared artifacts.

Artifacts are content-addressed per namespace (``artifact.py``): two ModelDeployments
that ask for the same bytes on the same storage share one location. So an artifact is
*referenced* by every ModelDeployment that keeps it (the newest ``retention.keep`` of its
history, its current artifact, its rollback target while a rollout may still need it) or
wants it (the location its spec asks for, maybe being staged right now), and it is
deleted only when a ModelDeployment lets it go and no other references it. Locations are
compared by URI, not digest: the digest does not cover the storage, so one digest can live
on two claims.

Pure functions over statuses; ``act.py`` executes the plan with clean-up Jobs
(``job_plan.plan_cleanup_job``) before it writes the trimmed history.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from modelstage.api.modeldeployment import ArtifactStatus, ModelDeploymentStatus


@dataclass(frozen=True)
class Holder:
    """One ModelDeployment as retention sees it."""

    status: ModelDeploymentStatus
    keep: int
    wants: str | None = None
    """The URI of the artifact its spec asks for (None when the spec is invalid)."""


@dataclass(frozen=True)
class RetentionPlan:
    history: tuple[ArtifactStatus, ...]
    """The ModelDeployment's history after retention (what it still references)."""
    delete: tuple[ArtifactStatus, ...]
    """Let go and referenced by no other ModelDeployment: clean these up."""
    released: tuple[ArtifactStatus, ...] = ()
    """Let go but still referenced elsewhere: dropped from the history, left on storage."""

    @property
    def details(self) -> str:
        if not self.delete and not self.released:
            return ""
        parts = [f"deleting artifact {a.digest} ({a.uri})" for a in self.delete]
        parts += [
            f"artifact {a.digest} is let go but another ModelDeployment keeps it"
            for a in self.released
        ]
        return "; ".join(parts)


def remember(status: ModelDeploymentStatus) -> ModelDeploymentStatus:
    """The history with the current artifact first (most recently used), then the rollback
    target, then the rest; one entry per location."""
    firsts = [a for a in (status.artifact, status.previous_artifact) if a is not None]
    history = _unique([*firsts, *status.artifacts])
    if history == status.artifacts:
        return status
    return status.model_copy(update={"artifacts": history})


def kept(holder: Holder) -> set[str]:
    """URIs a ModelDeployment references: the newest ``keep``, the current artifact, the
    rollback target until the rollout is done, and the artifact its spec wants."""
    status = holder.status
    uris = {a.uri for a in _unique(status.artifacts)[: holder.keep]}
    if status.artifact is not None:
        uris.add(status.artifact.uri)
    if status.previous_artifact is not None and status.phase != "Ready":
        uris.add(status.previous_artifact.uri)
    if holder.wants is not None:
        uris.add(holder.wants)
    return uris


def pinned_digests(status: ModelDeploymentStatus, keep: int, wants: str | None) -> set[str]:
    """The digests whose node-local copies a ModelDeployment pins (never evicted): those of
    the artifacts it references (``kept``: the newest ``keep``, the current one, the rollback
    target) and ``wants``, the digest its spec asks for (being staged or copied)."""
    uris = kept(Holder(status, keep))
    every = [a for a in (status.artifact, status.previous_artifact) if a is not None]
    digests = {a.digest for a in [*every, *status.artifacts] if a.uri in uris}
    if wants is not None:
        digests.add(wants)
    return digests


def plan_retention(own: Holder, others: Iterable[Holder]) -> RetentionPlan:
    """What ``own`` lets go of, and which of those no other ModelDeployment references."""
    mine = kept(own)
    elsewhere = set().union(*(kept(o) for o in others))
    history = _unique(own.status.artifacts)
    let_go = [a for a in history if a.uri not in mine]
    return RetentionPlan(
        history=tuple(a for a in history if a.uri in mine),
        delete=tuple(a for a in let_go if a.uri not in elsewhere),
        released=tuple(a for a in let_go if a.uri in elsewhere),
    )


def plan_release(own: Holder, others: Iterable[Holder]) -> RetentionPlan:
    """The ModelDeployment is being deleted: it references nothing any more."""
    status = own.status
    every = _unique(
        [a for a in (status.artifact, status.previous_artifact) if a is not None]
        + list(status.artifacts)
    )
    gone = Holder(ModelDeploymentStatus(artifacts=every), keep=0)
    return plan_retention(gone, others)


def _unique(artifacts: Sequence[ArtifactStatus]) -> list[ArtifactStatus]:
    seen: set[str] = set()
    out = []
    for artifact in artifacts:
        if artifact.uri not in seen:
            seen.add(artifact.uri)
            out.append(artifact)
    return out
