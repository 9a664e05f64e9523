"""The ``NodeCache`` API (``modelstage.io/v1alpha1``, cluster-scoped): one per node, named after
it. Its spec says what the node must keep and warm (written by the operator only); its status
is the node agent's report of what the node's cache holds (written by that agent only).

The operator finds "node N holds (namespace, digest)" as: N's report has a copy whose
``grants`` contain that pair; the copy's ``content`` and ``label`` are what a node-cache
PersistentVolume names. The on-node layout and the names the parts share are in
``modelstage.core.node_cache``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field

from .modeldeployment import Model


class Grant(Model):
    """A namespace that proved it holds a copy's content (it streamed every byte of it), for
    one spec digest of one of its ModelDeployments."""

    model_config = ConfigDict(extra="ignore", strict=False)
    namespace: str
    digest: str


class NodeCacheSpec(Model):
    """What the operator asks of the node: copies granted to these (namespace, digest) pairs
    are never evicted (``keep``) and are read into the page cache now (``warm``)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    keep: list[Grant] = Field(default_factory=list)
    warm: list[Grant] = Field(default_factory=list)


class HeldCopy(Model):
    """A complete, verified copy on the node, named by its content."""

    model_config = ConfigDict(extra="ignore", strict=False)
    content: str
    label: str
    """The node label (``core.node_cache.content_label``) the agent sets for this copy."""
    bytes: int
    """Counted from the disk (the files present), never taken from a manifest."""
    files: int | None = None
    copied_at: datetime | None = None
    copy_seconds: float | None = None
    """How long the copy took (its bytes over this: the node's copy rate)."""
    last_used: datetime | None = None
    """When the spec last kept it: eviction goes oldest first."""
    last_verified: datetime | None = None
    """When every chunk was last read back and checked (``--verify-rate``)."""
    pinned: bool = False
    """Granted to a (namespace, digest) in the spec's ``keep``: never evicted."""
    warm: bool = False
    """Read into the page cache on request (the spec's ``warm``)."""
    warmed_at: datetime | None = None
    grants: list[Grant] = Field(default_factory=list)
    """Who proved possession of this content, for which spec digest."""


class PartialCopy(Model):
    """A copy being received, or left by one that stopped (a retry resumes it)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    content: str
    bytes: int
    copying: bool = False
    """A copy is being received for it now."""


class NodeCacheReport(Model):
    """The agent's report (``status``)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    node: str
    root: str
    """The node-local root, on the host."""
    budget_bytes: int
    bytes_held: int = 0
    """Bytes of complete and partial copies, counted from the disk."""
    free_bytes: int | None = None
    """Free bytes of the root's filesystem (``statvfs``)."""
    endpoint: str | None = None
    """Where copy Jobs stream to (``http://<pod IP>:<copy port>``)."""
    heartbeat: datetime
    """When the agent last wrote this; an old one means the agent is gone."""
    copies: list[HeldCopy] = Field(default_factory=list)
    partial: list[PartialCopy] = Field(default_factory=list)
    evictions: int = 0
    """Copies evicted since the agent started."""
    verify_failures: int = 0
    """Copies dropped by re-verification since the agent started."""
    copy_bytes_per_second: float | None = None
    """The most recent copy's rate."""
    interval_seconds: float | None = None
    """The agent's pass interval: how old a heartbeat may get while the agent still runs."""
    message: str = ""
    """What the agent could not do (over budget with everything pinned, an entry of the root
    it could not read, a copy refused for lack of room)."""


class NodeCacheObject(Model):
    """A node's cache: ``metadata.name`` is the node's name."""

    model_config = ConfigDict(extra="ignore", strict=False)
    api_version: Literal["modelstage.io/v1alpha1"] = "modelstage.io/v1alpha1"
    kind: Literal["NodeCache"] = "NodeCache"
    metadata: dict[str, Any]
    spec: NodeCacheSpec | None = None
    status: NodeCacheReport | None = None
