"""``modelstage delete``: remove one artifact, manifest first, so it never looks complete
while half-deleted.

The operator runs this in a small clean-up Job (it mounts no PVC and holds no S3
credentials itself) for artifacts that retention or a ModelDeployment's deletion let go.
Deleting is idempotent: an artifact already gone is success, and a rerun finishes what a
killed run left. The manifest goes first (and, locally, the directory is renamed aside
before the tree is removed), so a reader that races the delete sees "incomplete", never a
complete artifact with files missing. Only artifact-shaped locations are touched: the last
path element must be a digest, and a manifest there must carry the expected one.
"""

from __future__ import annotations

import fcntl
import os
import re
import uuid
from pathlib import Path
from typing import Any

from .destinations.local import fsync_dir, open_lock, remove_leftover
from .digest import DIGEST_HEX_CHARS
from .errors import ArtifactError, DestinationError, SpecError
from .manifest import MANIFEST, read_manifest
from .s3_client import S3Options

DIGEST_NAME = re.compile(rf"^[0-9a-f]{{{DIGEST_HEX_CHARS}}}$")
DELETE_BATCH = 1000
"""S3's DeleteObjects limit per request."""


def delete_artifact(
    artifact: str, *, digest: str | None = None, s3: S3Options | None = None
) -> dict[str, Any]:
    """Delete the artifact at ``artifact`` (a directory or ``s3://bucket/prefix/<digest>``)."""
    name = artifact.rstrip("/").rsplit("/", 1)[-1]
    if not DIGEST_NAME.match(name):
        raise SpecError(
            f"{artifact}: not an artifact location (the last path element must be a "
            f"{DIGEST_HEX_CHARS}-character digest); refusing to delete it"
        )
    if digest is not None and digest != name:
        raise SpecError(f"{artifact}: the location is artifact {name}, not {digest}")
    if artifact.startswith("s3://"):
        removed = _delete_s3(artifact, name, s3)
    else:
        removed = _delete_local(Path(artifact.removeprefix("file://")), name)
    return {"deleted": artifact, "digest": name, "removed": removed}


def _delete_local(out: Path, digest: str) -> int:
    """Under the location's lock (a stager writing it makes this fail, to be retried)."""
    out = out.absolute()
    if not out.parent.is_dir():
        return 0
    lock = out.parent / f".{out.name}.lock"
    fd = open_lock(lock)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DestinationError(f"{out}: a stager is writing it right now; retry") from None
        removed = _remove_tree(out, digest)
        lock.unlink()
    finally:
        os.close(fd)
    return removed


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
    return removed


def _delete_s3(uri: str, digest: str, options: S3Options | None) -> int:
    from .destinations.s3 import S3Destination

    dest = S3Destination(uri, options)
    manifest = dest.existing()
    if manifest is not None and manifest.digest != digest:
        raise ArtifactError(f"{uri}: its manifest says artifact {manifest.digest}, not {digest}")
    client, bucket = dest.s3.client, dest.location.bucket
    removed = 0
    if manifest is not None:
        key = dest.location.key(MANIFEST)
        dest.call(lambda: client.delete_object(Bucket=bucket, Key=key), key)
        removed += 1
    prefix = dest.location.prefix + "/"
    uploads = dest.call(lambda: client.list_multipart_uploads(Bucket=bucket, Prefix=prefix), prefix)
    for upload in uploads.get("Uploads", []):
        dest.call(lambda u=upload: client.abort_multipart_upload(
            Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]), upload["Key"])  # fmt: skip
    keys = [prefix + name for name in dest._list()]
    for start in range(0, len(keys), DELETE_BATCH):
        batch = [{"Key": k} for k in keys[start : start + DELETE_BATCH]]
        result = dest.call(lambda b=batch: client.delete_objects(
            Bucket=bucket, Delete={"Objects": b, "Quiet": True}), prefix)  # fmt: skip
        if result.get("Errors"):
            first = result["Errors"][0]
            raise ArtifactError(f"s3://{bucket}/{first.get('Key')}: not deleted: "
                                f"{first.get('Code')} {first.get('Message')}")  # fmt: skip
        removed += len(batch)
    return removed
