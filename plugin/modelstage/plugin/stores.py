"""Where a rank's bytes come from: local files (``preadv``) or S3 objects (ranged GETs).

The pipelined reader (``reader.py``) plans chunks from the headers and asks a store to fill
lists of memory views — parameter memory on a host, pinned buffers for CUDA — with a file's
bytes from an offset on. Both stores write straight into those views: ``preadv`` on a local
file, and for S3 the socket's ``readinto`` on the response of one ranged GET, so neither
allocates a buffer per read. Every GET carries ``If-Match`` with the ETag the verify phase
saw: an object replaced after verification fails the load instead of mixing two artifacts.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from modelstage.core.errors import ArtifactError
from modelstage.core.integrity import open_regular
from modelstage.core.s3_client import S3Client, S3Location, get_range_into, precondition_failed
from modelstage.core.safetensors_format import SafetensorsHeader

if TYPE_CHECKING:
    from .checks import VerifiedArtifact

IOV_MAX = 1024
"""Linux's limit on iovecs per ``preadv``."""


class RankBytes(ABC):
    """A rank's files, in load order, with their verified headers."""

    @property
    @abstractmethod
    def headers(self) -> Sequence[SafetensorsHeader]: ...

    @abstractmethod
    def where(self, file: int) -> str:
        """The file's path or URI, for messages."""

    @abstractmethod
    def read_into(self, file: int, offset: int, views: list[memoryview]) -> None:
        """Fill ``views``, in order, with the file's bytes from ``offset`` on; thread-safe."""

    @abstractmethod
    def open(self) -> None:
        """Acquire what reads need (file descriptors); called once before the first read."""

    @abstractmethod
    def close(self) -> None:
        """Release what ``open`` acquired."""

    def __enter__(self) -> RankBytes:
        self.open()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()


class LocalFiles(RankBytes):
    """Files on a local filesystem (a PVC): one vectored ``preadv`` per run of views."""

    def __init__(self, files: Sequence[tuple[Path, SafetensorsHeader]]) -> None:
        self.paths = [Path(p) for p, _ in files]
        self._headers = [h for _, h in files]
        self._fds: list[int] = []

    @property
    def headers(self) -> Sequence[SafetensorsHeader]:
        return self._headers

    def where(self, file: int) -> str:
        return str(self.paths[file])

    def open(self) -> None:
        try:
            for path in self.paths:
                fd = open_regular(path)
                self._fds.append(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def read_into(self, file: int, offset: int, views: list[memoryview]) -> None:
        fd, k, views = self._fds[file], 0, list(views)
        while k < len(views):
            n = os.preadv(fd, views[k : k + IOV_MAX], offset)
            if n == 0:
                raise ArtifactError(
                    f"{self.where(file)}: ends at byte {offset}, the header promised more; "
                    "the file changed after it was verified"
                )
            offset += n
            while k < len(views) and n >= len(views[k]):
                n -= len(views[k])
                k += 1
            if n:
                views[k] = views[k][n:]


@dataclass(frozen=True)
class S3RankObject:
    """One verified rank object: where it is, the ETag it had, its header."""

    location: S3Location
    name: str
    etag: str
    header: SafetensorsHeader
    prefix: bytes | None = None
    """The object's first bytes, checked by the verify phase: served without a GET."""

    @property
    def uri(self) -> str:
        return f"{self.location.uri}{self.name}"


class S3Objects(RankBytes):
    """Objects in S3: one ranged GET (``If-Match`` the verified ETag) per run of views."""

    def __init__(self, client: S3Client, objects: Sequence[S3RankObject]) -> None:
        self.client = client
        self.objects = list(objects)

    @property
    def headers(self) -> Sequence[SafetensorsHeader]:
        return [o.header for o in self.objects]

    def where(self, file: int) -> str:
        return self.objects[file].uri

    def open(self) -> None:
        """Nothing to open: botocore pools the connections."""

    def close(self) -> None:
        """Nothing to close."""

    def read_into(self, file: int, offset: int, views: list[memoryview]) -> None:
        obj = self.objects[file]
        views = list(views)
        if obj.prefix is not None and offset < len(obj.prefix):  # checked bytes, in memory
            source = memoryview(obj.prefix)[offset:]
            while views and len(source):
                n = min(len(views[0]), len(source))
                views[0][:n] = source[:n]
                offset, source = offset + n, source[n:]
                views[0] = views[0][n:]
                if not len(views[0]):
                    views.pop(0)
            if not views:
                return
        try:
            get_range_into(
                self.client,
                obj.location.bucket,
                obj.location.key(obj.name),
                obj.etag,
                offset,
                views,
            )
        except Exception as e:
            if precondition_failed(e):
                raise ArtifactError(
                    f"{obj.uri}: the object changed after it was verified (its ETag is no "
                    f"longer {obj.etag}); restart the load to verify the new artifact"
                ) from None
            raise ArtifactError(str(self.client.error(e, obj.uri))) from None


def store_for(verified: VerifiedArtifact) -> RankBytes:
    """The verified files as a store: local files, or the S3 objects at their verified ETags."""
    if verified.s3 is None:
        return LocalFiles([(f.path, f.header) for f in verified.files])
    location = S3Location.parse(verified.location)
    objects = []
    for f in verified.files:
        assert f.etag is not None, f"{f.location}: verified without an ETag"
        objects.append(S3RankObject(location, f.name, f.etag, f.header, f.prefix))
    return S3Objects(verified.s3, objects)
