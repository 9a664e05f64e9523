"""The ``NodeCache`` API (``modelstage.io/v1alpha1``, cluster-scoped): one per node, named after
it, whose status is the node agent's report of what the node's cache holds.

The agent (``modelstage agent``) writes the status and nothing else; the operator reads it to
know which nodes hold which artifact, and whether they are warm. The on-node layout and the
names the parts share are in ``modelstage.core.node_cache``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field

from .api import Model


class HeldArtifact(Model):
    """A complete, verified copy on the node."""

    model_config = ConfigDict(extra="ignore", strict=False)
    digest: str
    bytes: int
    files: int | None = None
    copied_at: datetime | None = None
    copy_seconds: float | None = None
    """How long the copy took (its bytes over this: the node's copy rate)."""
    last_used: datetime | None = None
    """When a ModelDeployment last served, kept or asked for it: eviction goes oldest first."""
    pinned: bool = False
    """Served, kept for rollback or being rolled out by some ModelDeployment: never evicted."""
    warm: bool = False
    """Read into the page cache on request (a ModelDeployment's ``Warming`` phase)."""
    warmed_at: datetime | None = None


class PartialCopy(Model):
    """A copy in progress, or left by a copy that stopped (a retry resumes it)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    digest: str
    bytes: int
    copying: bool = False
    """A copier holds the digest's lock now."""


class NodeCacheReport(Model):
    """The agent's report (``status``)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    node: str
    root: str
    """The node-local root, on the host."""
    budget_bytes: int
    bytes_held: int = 0
    """Bytes of complete copies and partial ones."""
    heartbeat: datetime
    """When the agent last wrote this; an old one means the agent is gone."""
    artifacts: list[HeldArtifact] = Field(default_factory=list)
    partial: list[PartialCopy] = Field(default_factory=list)
    evictions: int = 0
    """Copies evicted since the agent started."""
    copy_bytes_per_second: float | None = None
    """The most recent copy's rate."""
    interval_seconds: float | None = None
    """The agent's pass interval: how old a heartbeat may get while the agent still runs."""
    message: str = ""
    """What the agent could not do (over budget with everything pinned, a root it cannot read)."""


class NodeCacheObject(Model):
    """A node's cache: ``metadata.name`` is the node's name."""

    model_config = ConfigDict(extra="ignore", strict=False)
    api_version: Literal["modelstage.io/v1alpha1"] = "modelstage.io/v1alpha1"
    kind: Literal["NodeCache"] = "NodeCache"
    metadata: dict[str, Any]
    status: NodeCacheReport | None = None
