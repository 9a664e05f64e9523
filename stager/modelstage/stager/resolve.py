"""Resolve a source to its identity before any work: what the artifact digest is taken from.

A moving reference (a Hub branch, an S3 prefix whose objects can be replaced, a folder that
can be rewritten in place) names different bytes over time, so the digest cannot come from
the request's text alone. ``resolve`` pins it first:

- ``hf://``: the commit the revision names now (one metadata request, no download; a full
  commit sha names itself);
- ``s3://``: the listing's ETags and sizes of the files the stager reads (and their headers
  are read, as staging would);
- ``oci://``: the image manifest's digest (one request; it pins every layer);
- a local folder or a mounted ``pvc://`` claim: per file its size and header hash (with the
  modification time) or the sha256 of a small file.

``modelstage stage`` resolves, computes the digest, and only then looks at ``--out``; the
operator runs ``modelstage resolve`` in a short Job (it never reaches the source itself) and
passes the identity to the stage Job, which refuses to stage a source that changed since.
The local and S3 sources opened for resolving are handed on to staging: their headers are read
once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modelstage.core.digest import SOURCE_CHANGED, identity_key
from modelstage.core.errors import CheckpointError
from modelstage.core.model_config import architecture_of, quantization_of

from .checkpoint import Checkpoint, open_checkpoint
from .sources import Source, open_source

if TYPE_CHECKING:
    from .request import StageRequest


@dataclass
class Resolved:
    """A source's identity now, and (local, S3) the source opened to read it."""

    uri: str
    """The canonical source URI: the digest's other source input."""
    revision: str | None
    identity: str
    """``identity_key`` of the source identity: ``commit:<sha>`` or ``sha256:<hex>``."""
    kind: str
    commit: str | None = None
    files: int | None = None
    bytes: int | None = None
    source: Source | None = field(default=None, repr=False)
    """Open, for staging to read on (None for ``hf://``: fetched at ``commit`` later)."""
    checkpoint: Checkpoint | None = field(default=None, repr=False)
    config: Mapping[str, Any] | None = field(default=None, repr=False)
    """The checkpoint's ``config.json`` when read (``loadFormat: auto`` decides by it)."""

    def summary(self) -> dict[str, Any]:
        """``modelstage resolve``'s one-line answer (also the resolve Job's termination
        message, which holds 4 KiB: no per-file detail)."""
        out: dict[str, Any] = {
            "uri": self.uri,
            "revision": self.revision,
            "identity": self.identity,
            "kind": self.kind,
            "digestInputs": {"uri": self.uri.rstrip("/"), "source": self.identity},
        }
        if self.commit is not None:
            out["commit"] = self.commit
        if self.files is not None:
            out["files"] = self.files
        if self.bytes is not None:
            out["bytes"] = self.bytes
        if self.config is not None:
            out["architecture"] = architecture_of(self.config)
            out["quantization"] = quantization_of(self.config)
        return out

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None


def canonical_uri(source: str) -> str:
    """A canonical URI for digests: absolute paths for local sources."""
    if "://" in source and not source.startswith("file://"):
        return source
    from pathlib import Path

    return "file://" + str(Path(source.removeprefix("file://")).absolute())


def resolve(req: StageRequest, *, config: bool = False) -> Resolved:
    """The source identity of ``req`` now; the caller closes the result. ``config``: read
    ``config.json`` also from the Hub (a local or S3 source's is read anyway)."""
    uri = req.source_uri or canonical_uri(req.source)
    if req.source.startswith("hf://"):
        return _resolve_hf(req, uri, config=config)
    if req.source.startswith("oci://"):
        from .sources.oci import OciSource

        digest = OciSource.resolve(req.source, oci=req.oci)
        return Resolved(uri, req.revision, f"oci:{digest}", "oci")
    source = open_source(
        req.source,
        revision=req.revision,
        s3=req.s3,
        azure=req.azure,
        oci=req.oci,
        hf_token_file=req.hf_token_file,
        cache_dir=req.cache_dir,
        timeouts=req.timeouts,
    )
    try:
        checkpoint = None
        identity = None
        if req.allow_pickle:
            from .sources.pickled import pickle_identity

            identity = pickle_identity(source)
        if identity is None:
            checkpoint = open_checkpoint(source)
            identity = checkpoint.identity()
        files = identity.get("files") or []
        return Resolved(
            uri,
            req.revision,
            identity_key(identity),
            str(identity.get("kind", "local")),
            files=len(files),
            bytes=sum(int(f.get("size", 0)) for f in files),
            source=source,
            checkpoint=checkpoint,
            config=checkpoint.config if checkpoint is not None else None,
        )
    except BaseException:
        source.close()
        raise


def _resolve_hf(req: StageRequest, uri: str, *, config: bool) -> Resolved:
    """A Hub source: the commit its revision names now (and its config.json, ``config``)."""
    from .sources.hf import HfSource

    options: dict[str, Any] = {
        "revision": req.revision,
        "hf_token_file": req.hf_token_file,
        "cache_dir": req.cache_dir,
        "timeouts": req.timeouts,
    }
    if not config:
        commit = HfSource.resolve(req.source, **options)
        return Resolved(uri, req.revision, f"commit:{commit}", "hf", commit=commit)
    commit, found = HfSource.resolve_config(req.source, **options)
    return Resolved(
        uri,
        req.revision,
        f"commit:{commit}",
        "hf",
        commit=commit,
        config=found if isinstance(found, dict) else {},
    )


def check_identity(resolved: str, read: dict[str, Any], uri: str) -> None:
    """The identity of what staging read must be the one the digest was taken from."""
    now = identity_key(read)
    if now != resolved:
        raise CheckpointError(
            f"{uri} changed while staging: it was {resolved} when resolved, it is {now} now; "
            "stage again to pick up the new content"
        )


def check_expected(resolved: Resolved, expected: str | None) -> None:
    """``--expect-identity``: the operator resolved the source earlier; a source that changed
    since is refused, so the operator resolves it again and stages it as a new artifact."""
    if expected is not None and resolved.identity != expected:
        raise CheckpointError(
            f"{resolved.uri} {SOURCE_CHANGED}: expected source identity {expected}, found "
            f"{resolved.identity}; resolve it again (the operator does) and stage the new "
            "content as a new artifact"
        )
