"""The small interface every checkpoint source implements, and the guards every source applies
to what it reads (file names, JSON sizes)."""

from __future__ import annotations

import abc
import json
import posixpath
from typing import Any

from modelstage.core.errors import CheckpointError, json_fault


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


MiB = 1024 * 1024
MAX_JSON_BYTES = 32 * MiB
"""The weight index: about 100 bytes per tensor, so room for MAX_TENSORS and long names."""
MAX_TENSORS = 262_144
"""Tensors in a checkpoint: several times the largest published mixture-of-experts models;
what a header or an index claims beyond it is refused before it is expanded."""
INDEX_VALUES = MAX_TENSORS + 1024
"""JSON values an index may hold: one per tensor, and its metadata."""


def parse_json(raw: bytes, name: str, *, max_values: int | None = None) -> Any:
    """JSON from an untrusted file, as a ``CheckpointError`` on any fault: invalid, nested
    past the parser's depth, numbers past Python's digit limit, or (``max_values``) more
    values than the file may hold, counted on the raw bytes before anything is built."""
    if max_values is not None:
        values = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
        if values > max_values:
            raise CheckpointError(
                f"{name}: holds about {values} JSON values, more than the {max_values} it may "
                "have; refusing it"
            )
    try:
        return json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{name}: invalid JSON: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, digit limits
        raise CheckpointError(f"{name}: invalid JSON: {json_fault(e)}") from None
