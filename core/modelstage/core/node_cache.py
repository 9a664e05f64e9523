"""Node-local artifact copies: the on-node layout and the names every part agrees on.

A node's cache is one fixed root that only the node agent (``modelstage agent``) writes. A
copy Job in a tenant's namespace (``modelstage node-copy``) streams an artifact's manifest and
files to the agent over HTTP; the agent checks every chunk against the manifest's hashes and
keeps the copy under its *content* (a hash of the canonical manifest, timing fields out), so
two tenants with the same bytes share one copy and a different content never replaces one. A
copy is made in ``.partial/<content>`` and renamed to ``<content>`` once every file is
verified and the canonical manifest written last, so a directory named by a content is always
complete; ``.state/<content>.json`` records when it was copied, used and verified, and which
namespaces proved they hold it (grants). A serving pod mounts only its own copy, read-only
(``modelstage prepare`` and the loader plugin read it).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from .digest import DIGEST_HEX_CHARS
from .errors import ArtifactError
from .integrity import MAX_CHUNK_BYTES as MAX_CHUNK_BYTES  # the manifest parser's cap
from .manifest import MAX_MANIFEST_BYTES, TIMING_FIELDS

DEFAULT_ROOT = "/var/lib/modelstage/node-cache"
"""The node-local root on the host (chart value ``nodeCache.root``; one root per cluster)."""
POD_MOUNT = "/modelstage/node-cache"
"""Where a serving pod mounts its own copy (read-only; the agent mounts the root there)."""
ENV_NODE_CACHE = "MODELSTAGE_NODE_CACHE"
"""Set in a serving pod's vLLM container: the mounted copy, where the plugin looks first."""
CONTENT_HEX_CHARS = 32
CACHE_GID = 65532
"""The agent's uid and gid; copies are 0440/0550 owned by it, so a serving pod reads its copy
with this gid in its ``supplementalGroups``."""
AGENT_AUDIENCE = "modelstage-node-agent"
"""The audience of the projected token a copy Job presents to the agent."""
DEFAULT_COPY_PORT = 9103
ENV_NODE_AGENT = "MODELSTAGE_NODE_AGENT"
ENV_NODE_AGENT_TOKEN_FILE = "MODELSTAGE_NODE_AGENT_TOKEN_FILE"
"""``modelstage node-copy``'s ``--agent`` and ``--token-file`` when not given."""
DEFAULT_TOKEN_FILE = "/var/run/secrets/modelstage/token"
PARTIAL = ".partial"
STATE = ".state"
LOCK_SUFFIX = ".lock"

LABEL_PREFIX = "cache.modelstage.io/"
"""A node holding a complete, verified copy carries ``content_label(content)=true`` (set by
that node's agent, the only labels it sets); a node-cache PV's node affinity names it."""
_LABEL_SALT = b"modelstage.io/node-label\0"

API_GROUP = "modelstage.io"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "NodeCache"
PLURAL = "nodecaches"
"""One cluster-scoped ``NodeCache`` per node, named after it: what the operator asks the node
to keep and warm (spec) and the agent's report (status)."""

WARMING = "Warming"
"""``status.nodeCache.phase`` of a ModelDeployment whose artifact its nodes should read into
the page cache now (the agents on the nodes listed in ``status.nodeCache.nodes`` do)."""

HIT, MISS = "hit", "miss"
"""``prepare``'s verdict on a pod's node (its summary's ``nodeCache.result``)."""
CORRUPT = "corrupt"
"""The loader plugin's third outcome: the node copy was trusted, then failed its verification,
and the artifact was read instead (logged as an error, counted by this name)."""

_DIGEST = re.compile(rf"^[0-9a-f]{{{DIGEST_HEX_CHARS}}}$")
_CONTENT = re.compile(rf"^[0-9a-f]{{{CONTENT_HEX_CHARS}}}$")


def check_digest(digest: str) -> str:
    """A digest names a directory under the root: nothing else (no ``..``, no slash) may."""
    if not _DIGEST.fullmatch(digest):
        raise ArtifactError(
            f"{digest!r} is not an artifact digest ({DIGEST_HEX_CHARS} lowercase hex characters)"
        )
    return digest


def check_content(content: str) -> str:
    """A content names a directory under the root: nothing else (no ``..``, no slash) may."""
    if not _CONTENT.fullmatch(content):
        raise ArtifactError(
            f"{content!r} is not a copy's content address ({CONTENT_HEX_CHARS} lowercase hex "
            "characters)"
        )
    return content


def canonical_manifest(manifest_bytes: bytes) -> bytes:
    """The manifest as every copy stores it: its JSON object without the timing fields,
    encoded canonically, so two runs that produced the same bytes give the same copy."""
    if len(manifest_bytes) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"invalid manifest: more than {MAX_MANIFEST_BYTES} bytes")
    try:
        doc = json.loads(manifest_bytes)
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"invalid manifest: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ArtifactError("invalid manifest: (root): must be a JSON object")
    for name in TIMING_FIELDS:
        doc.pop(name, None)
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return text.encode()


def content_address(manifest_bytes: bytes) -> str:
    """The content of an artifact: the first 32 hex of sha256 of its canonical manifest."""
    return hashlib.sha256(canonical_manifest(manifest_bytes)).hexdigest()[:CONTENT_HEX_CHARS]


def content_label(content: str) -> str:
    """The node label saying the node holds ``content``: opaque (a hash of the content with a
    salt of its own), so a label shows other tenants neither a digest nor a content."""
    salted = hashlib.sha256(_LABEL_SALT + check_content(content).encode()).hexdigest()
    return LABEL_PREFIX + salted[:20]


def copy_dir(root: Path, content: str) -> Path:
    """Where the complete copy of ``content`` lives (present only when complete)."""
    return root / check_content(content)


def partial_dir(root: Path, content: str) -> Path:
    """Where a copy of ``content`` is made; kept across agent restarts so a retry resumes."""
    return root / PARTIAL / check_content(content)


def lock_file(root: Path, content: str) -> Path:
    """Held (``flock``) while ``content`` is written, committed, removed or re-verified."""
    return root / PARTIAL / (check_content(content) + LOCK_SUFFIX)


def state_file(root: Path, content: str) -> Path:
    """The copy's record (JSON, 0600: ``content``, ``bytes``, ``files``, ``copiedAt``,
    ``copySeconds``, ``lastUsed``, ``lastVerified``, ``grants``); no URI, ever."""
    return root / STATE / (check_content(content) + ".json")
