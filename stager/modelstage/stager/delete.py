"""``modelstage delete``: remove one artifact, manifest first, so it never looks complete
while half-deleted.

The operator runs this in a small clean-up Job (it mounts no PVC and holds no S3
credentials itself) for artifacts that retention or a ModelDeployment's deletion let go.
Deleting is idempotent: an artifact already gone is success, and a rerun finishes what a
killed run left. The manifest goes first (and, locally, the directory is renamed aside
before the tree is removed), so a reader that races the delete sees "incomplete", never a
complete artifact with files missing. An artifact's engine caches (its siblings
``<digest>.engine-<key>``, folders or S3 prefixes, ``core/engine_cache.py``) go with it, each
manifest first. Only artifacts are touched: a location named by its digest (the operator's
layout; a manifest there must carry that digest), or any folder or prefix holding a manifest
(what ``stage --out DIR`` makes), whose digest ``--digest``, when given, must match.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from modelstage.core.digest import DIGEST_HEX_CHARS
from modelstage.core.durable import fsync_dir
from modelstage.core.engine_cache import ENGINE_MANIFEST
from modelstage.core.errors import ArtifactError, DestinationError, SpecError
from modelstage.core.formats import OCI
from modelstage.core.location import (
    AzureArtifact,
    LocalArtifact,
    S3Artifact,
    open_artifact,
    parse_location,
)
from modelstage.core.manifest import MANIFEST, read_manifest
from modelstage.core.s3_client import S3Options

from .destinations.local import LocationLock, remove_leftover

DIGEST_NAME = re.compile(rf"^[0-9a-f]{{{DIGEST_HEX_CHARS}}}$")
DELETE_BATCH = 1000
"""S3's DeleteObjects limit per request."""


def delete_artifact(
    artifact: str, *, digest: str | None = None, s3: S3Options | None = None
) -> dict[str, Any]:
    """Delete the artifact at ``artifact`` (a directory, an ``s3://bucket/prefix`` or an
    ``az://container/prefix``)."""
    _refuse_oci(artifact)
    name = artifact.rstrip("/").rsplit("/", 1)[-1]
    if DIGEST_NAME.match(name):
        if digest is not None and digest != name:
            raise SpecError(f"{artifact}: the location is artifact {name}, not {digest}")
        expected = name
    else:
        named = _digest_of_named(artifact, digest, s3)
        if named is None:
            return {"deleted": artifact, "digest": digest, "removed": 0}
        expected = named
    removed = remove_artifact(artifact, expected, s3)
    return {"deleted": artifact, "digest": expected, "removed": removed}


def _digest_of_named(artifact: str, digest: str | None, s3: S3Options | None) -> str | None:
    """A location not named by a digest is an artifact only if it holds a manifest: its
    digest then stands for the name (None: nothing is there, nothing to do)."""
    found = open_artifact(artifact, s3)
    if isinstance(found, LocalArtifact):
        path = found.directory
        manifest = read_manifest(path) if path.is_dir() else None
        present = path.exists()
    else:
        manifest, present = found.read_manifest(), bool(found.listing())
    if manifest is None:
        if not present:
            return None
        raise SpecError(
            f"{artifact}: not an artifact (it holds no {MANIFEST}, and its name is not a "
            f"{DIGEST_HEX_CHARS}-character digest); refusing to delete it. An interrupted "
            "stage or delete leaves no manifest: remove such a folder or prefix by hand"
        )
    if digest is not None and digest != manifest.digest:
        raise SpecError(f"{artifact}: its manifest says artifact {manifest.digest}, not {digest}")
    return manifest.digest


def _refuse_oci(location: str) -> None:
    if parse_location(location).kind == OCI:
        raise SpecError(
            f"{location}: an image in a registry is deleted with the registry's own tools "
            "(e.g. `skopeo delete docker://REGISTRY/REPOSITORY@sha256:...`), which also know "
            "its garbage collection; `stage --force` re-points a tag"
        )


def remove_artifact(location: str, digest: str, s3: S3Options | None = None) -> int:
    """Delete the artifact of ``digest`` at any location, manifest first (``stage --force``:
    a CLI ``--out`` is named by the user, not by the digest)."""
    _refuse_oci(location)
    found = open_artifact(location, s3)
    if isinstance(found, S3Artifact):
        return _delete_s3(found, digest)
    if isinstance(found, AzureArtifact):
        return _delete_azure(found, digest)
    return _delete_local(parse_location(location).path, digest)


def _delete_local(out: Path, digest: str) -> int:
    """Under the location's lock (a stager writing it makes this fail, to be retried)."""
    out = out.absolute()
    if not out.parent.is_dir():
        return 0
    lock = LocationLock(out)
    if not lock.acquire(exclusive=True):
        raise DestinationError(f"{out}: a stager is writing it right now; retry")
    try:
        return _remove_tree(out, digest)
    finally:
        lock.release()


def _remove_tree(out: Path, digest: str) -> int:
    removed = 0
    if out.is_symlink():  # not an artifact the stager wrote: the link goes, never its target
        out.unlink()
        fsync_dir(out.parent)
        removed += 1
    elif out.is_dir():
        manifest = read_manifest(out) if (out / MANIFEST).exists() else None
        if manifest is not None and manifest.digest != digest:
            raise ArtifactError(
                f"{out}: its manifest says artifact {manifest.digest}, not {digest}; not deleted"
            )
        if manifest is not None:
            (out / MANIFEST).unlink()
            fsync_dir(out)
            removed += 1
        aside = out.parent / f"{out.name}.tmp-delete-{uuid.uuid4().hex[:8]}"
        os.rename(out, aside)  # the location is free at once; the tree goes below
        fsync_dir(out.parent)
    elif out.exists():
        raise ArtifactError(f"{out} is not a directory; not deleted")
    for stale in out.parent.glob(f"{out.name}.tmp-*"):
        removed += remove_leftover(stale)
    return removed + _remove_engine_caches(out)


def _remove_engine_caches(out: Path) -> int:
    """The artifact's engine caches, its siblings ``<digest>.engine-<key>`` (and what a killed
    capture left beside them): each one's manifest first, so none looks complete while its
    files go."""
    removed = 0
    for cache in sorted(out.parent.glob(f"{out.name}.engine-*")):
        manifest = cache / ENGINE_MANIFEST
        if not cache.is_symlink() and cache.is_dir() and manifest.is_file():
            manifest.unlink()
            fsync_dir(cache)
        removed += remove_leftover(cache)
    if removed:
        fsync_dir(out.parent)
    return removed


def _delete_s3(found: S3Artifact, digest: str) -> int:
    uri, bucket, client = found.uri, found.location.bucket, found.s3.client
    manifest = found.read_manifest()
    if manifest is not None and manifest.digest != digest:
        raise ArtifactError(f"{uri}: its manifest says artifact {manifest.digest}, not {digest}")
    removed = 0
    if manifest is not None:
        key = found.location.key(MANIFEST)
        found.call(lambda: client.delete_object(Bucket=bucket, Key=key), key)
        removed += 1
    prefix = found.location.prefix + "/"
    uploads = found.call(
        lambda: client.list_multipart_uploads(Bucket=bucket, Prefix=prefix), prefix
    )
    for upload in uploads.get("Uploads", []):
        found.call(
            lambda u=upload: client.abort_multipart_upload(
                Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]
            ),
            upload["Key"],
        )
    removed += _delete_keys(found, [prefix + name for name in found.listing()])
    return removed + _remove_s3_engine_caches(found)


def _remove_s3_engine_caches(found: S3Artifact) -> int:
    """The artifact's engine caches on S3, the prefixes ``<digest>.engine-<key>/``: every
    manifest first, so none looks complete while its files go."""
    bucket, client = found.location.bucket, found.s3.client
    prefix = f"{found.location.prefix}.engine-"
    pages = found.call(
        lambda: list(client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                      Prefix=prefix)),
        prefix,
    )  # fmt: skip
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    manifests = [k for k in keys if k.endswith(f"/{ENGINE_MANIFEST}")]
    return _delete_keys(found, manifests) + _delete_keys(
        found, [k for k in keys if k not in set(manifests)]
    )


def _delete_keys(found: S3Artifact, keys: list[str]) -> int:
    bucket, client = found.location.bucket, found.s3.client
    for start in range(0, len(keys), DELETE_BATCH):
        batch = [{"Key": k} for k in keys[start : start + DELETE_BATCH]]
        result = found.call(
            lambda b=batch: client.delete_objects(
                Bucket=bucket, Delete={"Objects": b, "Quiet": True}
            ),
            batch[0]["Key"],
        )
        if result.get("Errors"):
            first = result["Errors"][0]
            raise ArtifactError(
                f"s3://{bucket}/{first.get('Key')}: not deleted: "
                f"{first.get('Code')} {first.get('Message')}"
            )
    return len(keys)


def _delete_azure(found: AzureArtifact, digest: str) -> int:
    """The manifest blob first, then every other blob under the prefix (uncommitted blocks
    are invisible and dropped by Azure)."""
    manifest = found.read_manifest()
    if manifest is not None and manifest.digest != digest:
        raise ArtifactError(
            f"{found.uri}: its manifest says artifact {manifest.digest}, not {digest}"
        )
    container, removed = found.az.client, 0
    names = [MANIFEST] if manifest is not None else []
    names += sorted(n for n in found.listing() if n != MANIFEST)
    for name in names:
        key = found.location.key(name)
        found.call(lambda k=key: container.delete_blob(k), key)
        removed += 1
    return removed
