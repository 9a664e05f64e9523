"""Node-local artifact copies: the on-node layout and the names every part agrees on.

A node's cache is one fixed root (a hostPath or a local PV) holding complete artifact copies
under their digest. Three parts meet there, none importing another: the copy Job
(``modelstage node-copy``, writes), the node agent (``modelstage agent``, reports, warms,
evicts) and the serving pod (``modelstage prepare`` and the loader plugin, read-only). A copy
is made in ``.partial/<digest>`` and renamed to ``<digest>`` once every file is verified and
the manifest written last, so a directory named by a digest is always complete; its record in
``.state/<digest>.json`` says when it was copied, how fast, and when it was last used.
"""

from __future__ import annotations

import re
from pathlib import Path

from .digest import DIGEST_HEX_CHARS
from .errors import ArtifactError

DEFAULT_ROOT = "/var/lib/modelstage/node-cache"
"""The node-local root on the host (chart value ``nodeCache.root``; one root per cluster)."""
POD_MOUNT = "/modelstage/node-cache"
"""Where serving pods and copy Jobs mount the root (read-only in serving pods)."""
ENV_NODE_CACHE = "MODELSTAGE_NODE_CACHE"
"""Set in a serving pod's vLLM container: the mounted root, where the plugin looks first."""
PARTIAL = ".partial"
STATE = ".state"
LOCK_SUFFIX = ".lock"

LABEL_PREFIX = "cache.modelstage.io/"
"""A node holding a complete, verified copy of an artifact carries ``<prefix><digest>=true``
(set by that node's agent); serving pods prefer nodes with the label."""

API_GROUP = "modelstage.io"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "NodeCache"
PLURAL = "nodecaches"
"""One cluster-scoped ``NodeCache`` per node, named after it: the agent's report (status)."""

WARMING = "Warming"
"""``status.nodeCache.phase`` of a ModelDeployment whose artifact its nodes should read into
the page cache now (the agents on the nodes listed in ``status.nodeCache.nodes`` do)."""

HIT, MISS = "hit", "miss"
"""``prepare``'s verdict on a pod's node (its summary's ``nodeCache.result``)."""
CORRUPT = "corrupt"
"""The loader plugin's third outcome: the node copy was trusted, then failed its verification,
and the artifact was read instead (logged as an error, counted by this name)."""

_DIGEST = re.compile(rf"^[0-9a-f]{{{DIGEST_HEX_CHARS}}}$")


def check_digest(digest: str) -> str:
    """A digest names a directory under the root: nothing else (no ``..``, no slash) may."""
    if not _DIGEST.fullmatch(digest):
        raise ArtifactError(
            f"{digest!r} is not an artifact digest ({DIGEST_HEX_CHARS} lowercase hex characters)"
        )
    return digest


def node_label(digest: str) -> str:
    """The node label that says the node holds ``digest``."""
    return LABEL_PREFIX + check_digest(digest)


def copy_dir(root: Path, digest: str) -> Path:
    """Where the complete copy of ``digest`` lives (present only when complete)."""
    return root / check_digest(digest)


def partial_dir(root: Path, digest: str) -> Path:
    """Where a copy of ``digest`` is made; kept across crashes so a retry resumes."""
    return root / PARTIAL / check_digest(digest)


def lock_file(root: Path, digest: str) -> Path:
    """Held (``flock``) by the one process copying ``digest``; the agent never evicts or
    cleans a digest whose lock is held."""
    return root / PARTIAL / (check_digest(digest) + LOCK_SUFFIX)


def state_file(root: Path, digest: str) -> Path:
    """The copy's record (JSON: ``digest``, ``bytes``, ``files``, ``copiedAt``,
    ``copySeconds``, ``source``, ``lastUsed``), written atomically next to the copies."""
    return root / STATE / (check_digest(digest) + ".json")
