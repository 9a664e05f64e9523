"""The small interface every checkpoint source implements, and the URI -> source registry."""

from __future__ import annotations

import abc
import importlib
import posixpath
from typing import Any

from modelstage.core.errors import CheckpointError


class Source(abc.ABC):
    """A read-only tree of files addressed by relative POSIX names.

    The stager reads headers first, then exactly the byte ranges the shard plan needs, so
    sources only offer ranged reads; a remote source can serve them with ranged GETs.
    """

    uri: str
    direct_reads: bool = False
    """Ranged reads are cheap and thread-safe enough (a local file) for each rank's writer to
    read its own rows straight into its output buffer; others are read ahead in large
    chunks, once, by the rank writer's reader thread."""

    @abc.abstractmethod
    def list_files(self) -> list[str]:
        """Relative names of the files at the top level of the checkpoint, sorted."""

    @abc.abstractmethod
    def size(self, name: str) -> int: ...

    @abc.abstractmethod
    def read_range(self, name: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``offset``; a short read is a CheckpointError."""

    def read_bytes(self, name: str, *, max_bytes: int) -> bytes:
        """The whole file, when it holds at most ``max_bytes``: the size a source reports
        (an S3 listing, a file's) is a claim, never a reason to allocate."""
        size = self.size(name)
        if size > max_bytes:
            raise CheckpointError(
                f"{self.uri}: {name} holds {size} bytes, more than the {max_bytes} this file "
                "may have; refusing it"
            )
        buf = bytearray(size)
        self.read_range(name, 0, memoryview(buf))
        return bytes(buf)

    @abc.abstractmethod
    def identity(self, files: list[str]) -> dict[str, Any]:
        """What pins the source's content (commit sha, ETags, or size + header hash)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most sources hold nothing
        """Release open handles."""


def safe_name(name: str, where: str) -> str:
    """Refuse names that could escape the checkpoint root (from indexes, listings, URIs)."""
    norm = posixpath.normpath(name)
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or norm != name
        or norm == ".."
        or norm.startswith("../")
    ):
        raise CheckpointError(f"{where}: refusing unsafe file name {name!r}")
    return name


SCHEMES: dict[str, str] = {
    "hf": ".hf:HfSource",
    "s3": ".s3:S3Source",
}
"""URI scheme -> ``module:class`` in this package; each class has ``from_uri(uri, **options)``.
Imported lazily, so that a local stage never imports boto3 or huggingface_hub."""


def open_source(uri: str, **options: Any) -> Source:
    """The source for a URI: a local path (or ``file://``), or a scheme from ``SCHEMES``.

    ``options`` are the request's source settings (``revision``, ``s3``, ``hf_token_file``,
    ``cache_dir``, the resolved hf ``commit``); each source takes the ones it understands and
    ignores the rest.
    """
    from .local import LocalSource

    if "://" not in uri or uri.startswith("file://"):
        return LocalSource(uri.removeprefix("file://"))
    scheme = uri.split("://", 1)[0]
    if scheme == "pvc":
        raise CheckpointError(
            f"{uri}: pvc:// sources are read where the claim is mounted; pass the mount path as "
            "SOURCE and the pvc:// URI as --source-uri (the operator does this)"
        )
    target = SCHEMES.get(scheme)
    if target is None:
        raise CheckpointError(
            f"source scheme {scheme}:// is not supported by this stager; supported: a local "
            f"path, file://, {', '.join(s + '://' for s in SCHEMES)}"
        )
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module, __package__), name)
    source: Source = cls.from_uri(uri, **options)
    return source
