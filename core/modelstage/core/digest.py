"""The artifact digest: a pure function of what changes the staged bytes.

The inputs are the request (URI, TP, PP, dtype, load format, layout version) and the
*resolved* source identity (``identity_key``): a moving reference (a Hub branch, an S3 prefix,
a folder) is resolved before the digest is taken, so a source that changed is a new artifact
and is never answered with the old one. The stager records both in the manifest; the operator
takes the identity from a short resolve step and computes the same digest. Artifacts are
stored under it, so equal requests of equal content share one artifact.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

DIGEST_HEX_CHARS = 20
"""80 bits: collision-safe per namespace, short enough for Kubernetes names (<= 63 chars)."""
IDENTITY_KEY = re.compile(r"^(commit:[0-9a-f]{40}|sha256:[0-9a-f]{64}|oci:sha256:[0-9a-f]{64})$")
"""``commit:<sha>`` for a Hub commit, ``oci:sha256:<hex>`` for an OCI image (its manifest
digest pins every layer), ``sha256:<hex>`` over any other source's identity."""
SOURCE_CHANGED = "changed since it was resolved"
"""What the stager's refusal of ``--expect-identity`` says, followed by ``found <identity>``:
the operator resolves the source again when a stage Job fails with it."""


def identity_key(identity: Mapping[str, Any]) -> str:
    """The short, stable form of a source identity that the digest takes: the commit for a
    Hub source (it pins every byte), else sha256 over the identity's canonical JSON (ETags,
    or path + size + header hash + modification time per file)."""
    commit = identity.get("commit")
    if commit:
        return f"commit:{commit}"
    if identity.get("kind") == "oci" and identity.get("manifestDigest"):
        return f"oci:{identity['manifestDigest']}"
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def artifact_digest(
    *,
    uri: str,
    source: str,
    tp: int,
    pp: int,
    dtype: str,
    load_format: str,
    layout_version: str,
    pp_partition: tuple[int, ...] | None = None,
) -> str:
    """Hex digest over the canonical JSON of the inputs; field order cannot change it.

    ``source`` is the resolved identity (``identity_key``); the requested revision is not an
    input: ``main`` and the commit it names are the same bytes. An explicit pipeline layer
    partition (``pp_partition``) is an input only when given: vLLM's default leaves every
    digest as it was."""
    if not IDENTITY_KEY.fullmatch(source):
        raise ValueError(f"not a resolved source identity: {source!r}")
    inputs: dict[str, object] = {
        "uri": uri.rstrip("/"),
        "source": source,
        "tp": tp,
        "pp": pp,
        "dtype": dtype,
        "format": load_format,
        "layout": layout_version,
    }
    if pp_partition is not None:
        inputs["ppPartition"] = list(pp_partition)
    canonical = json.dumps(
        inputs,
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_HEX_CHARS]
