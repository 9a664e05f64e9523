"""A checkpoint in an OCI image: ``oci://REGISTRY/REPOSITORY[:TAG|@sha256:...]``.

Two kinds of image are read:

- a **ModelPack** (or any artifact whose layers are files titled with their names,
  ``org.opencontainers.image.title``): each raw layer is one checkpoint file;
- a **modelcar** or any other image of tar layers: the layers are unpacked in order
  (whiteouts applied), and the checkpoint is the files under ``/models`` (or, when there is
  no ``/models``, the files at the image's root).

Every layer is read whole, once, and hashed on the way into a spool directory; only a layer
whose bytes hash to its digest is used, so a layer altered or truncated in the registry is
refused before any of it is staged. Raw layers are fetched when first read, tar layers when
the source is opened (their file list is inside them). The spool is removed at ``close``.

The identity is the image manifest's digest (``oci:sha256:...``): it pins every layer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from modelstage.core.errors import CheckpointError
from modelstage.core.oci_image import TITLE, Descriptor, ParsedImage, parse_image
from modelstage.core.oci_registry import (
    OciReference,
    RegistryClient,
    RegistryError,
    RegistryOptions,
)

from .base import Source, safe_name

TAR_TYPES = (
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.docker.image.rootfs.diff.tar",
)
"""Layer media types unpacked as tar (with ``+gzip`` or ``.gzip`` variants); ModelPack's
``...v1.tar`` layers too."""
SKIPPED_PREFIXES = ("application/vnd.oci.empty",)
MODELS = "models/"
WHITEOUT = ".wh."


@dataclass
class _File:
    size: int
    layer: str
    """The layer digest it comes from."""
    path: Path | None = None
    """Where it is spooled, once its layer has been fetched and checked."""


def _is_tar(media_type: str) -> bool:
    return media_type.startswith(TAR_TYPES) or ".tar" in media_type


class _HashingReader:
    """A file-like view of a blob's stream that hashes every byte read from it."""

    def __init__(self, blocks: Iterator[bytes]) -> None:
        self.blocks, self.block, self.pos = blocks, b"", 0
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        parts: list[bytes] = []
        want = n if n >= 0 else 1 << 62
        while want > 0:
            if self.pos == len(self.block):
                self.block, self.pos = next(self.blocks, b""), 0
                if not self.block:
                    break
            take = self.block[self.pos : self.pos + want]
            self.pos += len(take)
            want -= len(take)
            parts.append(take)
        out = b"".join(parts)
        self.sha.update(out)
        return out

    def drain(self) -> str:
        while self.read(1024 * 1024):
            pass
        return "sha256:" + self.sha.hexdigest()


class OciSource(Source):
    def __init__(
        self, uri: str, options: RegistryOptions | None = None, *, spool: str | None = None
    ) -> None:
        try:
            self.ref = OciReference.parse(uri)
            self.client = RegistryClient(self.ref, options)
            found = self.client.get_manifest(self.ref.reference)
        except RegistryError as e:
            raise CheckpointError(f"{uri}: {e}") from None
        if found is None:
            raise CheckpointError(f"{uri}: no such image in the registry (tag or digest absent)")
        self.uri = self.ref.uri
        try:
            self.image: ParsedImage = parse_image(found[0], found[1], self.uri)
        except Exception as e:
            raise CheckpointError(str(e)) from None
        self.spool = Path(tempfile.mkdtemp(prefix="modelstage-oci-", dir=spool))
        self._locks: dict[str, threading.Lock] = {}
        try:
            self.files = self._index()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_uri(
        cls, uri: str, *, oci: RegistryOptions | None = None, cache_dir: str | None = None, **_: Any
    ) -> OciSource:
        return cls(uri, oci, spool=cache_dir)

    @staticmethod
    def resolve(uri: str, *, oci: RegistryOptions | None = None) -> str:
        """The image manifest's digest now (one request)."""
        try:
            ref = OciReference.parse(uri)
            found = RegistryClient(ref, oci).get_manifest(ref.reference)
        except RegistryError as e:
            raise CheckpointError(f"{uri}: {e}") from None
        if found is None:
            raise CheckpointError(f"{uri}: no such image in the registry (tag or digest absent)")
        return found[1]

    def _index(self) -> dict[str, _File]:
        """Titled raw layers as files; tar layers unpacked now (their names are inside)."""
        raw = [d for d in self.image.layers if not _is_tar(d.media_type)]
        tars = [d for d in self.image.layers if _is_tar(d.media_type)]
        files: dict[str, _File] = {}
        for d in raw:
            if d.media_type.startswith(SKIPPED_PREFIXES):
                continue
            title = d.annotations.get(TITLE)
            if not title:
                raise CheckpointError(
                    f"{self.uri}: layer {d.digest} ({d.media_type}) has no "
                    f"{TITLE} annotation naming its file"
                )
            if "/" in safe_name(title, self.uri):
                continue  # not at the checkpoint's top level
            files[title] = _File(d.size, d.digest)
            self._locks[d.digest] = threading.Lock()
        if tars:
            files.update(self._unpack(tars))
        if not files:
            raise CheckpointError(f"{self.uri}: the image holds no checkpoint files")
        return files

    def _unpack(self, layers: list[Descriptor]) -> dict[str, _File]:
        root: dict[str, _File] = {}
        models: dict[str, _File] = {}
        for index, d in enumerate(layers):
            where = self.spool / f"layer-{index}"
            where.mkdir()
            reader = _HashingReader(self._blocks(d))
            try:
                with tarfile.open(fileobj=reader, mode="r|*") as tar:  # type: ignore[call-overload]
                    for member in tar:
                        self._take(tar, member, where, d.digest, root, models)
            except (tarfile.TarError, EOFError, OSError) as e:
                raise CheckpointError(
                    f"{self.client.where(d.digest)}: not a readable tar layer ({e}); zstd "
                    "layers are not supported: push uncompressed or gzip layers"
                ) from None
            self._check(d, reader.drain())
        return models or root

    def _take(
        self,
        tar: tarfile.TarFile,
        member: tarfile.TarInfo,
        where: Path,
        layer: str,
        root: dict[str, _File],
        models: dict[str, _File],
    ) -> None:
        """One tar entry: a flat file at the root or under ``models/``, or a whiteout."""
        name = member.name
        while name.startswith("./"):
            name = name[2:]
        name = name.lstrip("/")
        folder, base = (models, name[len(MODELS) :]) if name.startswith(MODELS) else (root, name)
        if not base or "/" in base:
            return  # directories and nested files: not a checkpoint's top level
        if base.startswith(WHITEOUT):
            folder.pop(base[len(WHITEOUT) :], None)
            return
        if not member.isreg():
            return
        safe_name(base, self.uri)
        target = where / f"{'m' if folder is models else 'r'}-{base}"
        extracted: IO[bytes] | None = tar.extractfile(member)
        assert extracted is not None
        with extracted, open(target, "wb") as out:
            shutil.copyfileobj(extracted, out, 1024 * 1024)
        folder[base] = _File(member.size, layer, target)

    def _blocks(self, d: Descriptor) -> Iterator[bytes]:
        try:
            yield from self.client.stream_blob(d.digest)
        except RegistryError as e:
            raise CheckpointError(str(e)) from None

    def _check(self, d: Descriptor, got: str) -> None:
        if got != d.digest:
            raise CheckpointError(
                f"{self.client.where(d.digest)}: the layer's bytes hash to {got}, not to its "
                "digest; the image is corrupt in the registry; refusing it"
            )

    def _fetch(self, name: str, entry: _File) -> Path:
        """A raw layer, spooled and checked against its digest (once)."""
        with self._locks[entry.layer]:
            if entry.path is not None:
                return entry.path
            d = next(d for d in self.image.layers if d.digest == entry.layer)
            part = self.spool / f"{name}.part"
            sha, size = hashlib.sha256(), 0
            with open(part, "wb") as out:
                for block in self._blocks(d):
                    sha.update(block)
                    size += len(block)
                    out.write(block)
            self._check(d, "sha256:" + sha.hexdigest())
            if size != entry.size:
                raise CheckpointError(
                    f"{self.client.where(d.digest)}: size differs from the manifest"
                )
            path = self.spool / name
            os.rename(part, path)
            entry.path = path
            return path

    def _entry(self, name: str) -> _File:
        entry = self.files.get(safe_name(name, self.uri))
        if entry is None:
            raise CheckpointError(f"{self.uri}: no file {name} in the image")
        return entry

    def list_files(self) -> list[str]:
        return sorted(self.files)

    def size(self, name: str) -> int:
        return self._entry(name).size

    def read_range(self, name: str, offset: int, out: memoryview) -> None:
        entry = self._entry(name)
        path = entry.path or self._fetch(name, entry)
        if offset < 0 or offset + len(out) > entry.size:
            raise CheckpointError(
                f"{self.uri} {name}: ends at byte {entry.size}, but bytes up to "
                f"{offset + len(out)} are needed; it is truncated"
            )
        with open(path, "rb") as f:
            got = os.preadv(f.fileno(), [out], offset)
        if got != len(out):
            raise CheckpointError(f"{self.uri} {name}: short read at byte {offset + got}")

    def identity(self, files: list[str]) -> dict[str, Any]:
        """The manifest digest pins every layer (``identity_key``: ``oci:<digest>``)."""
        return {
            "kind": "oci",
            "location": self.ref.name,
            "manifestDigest": self.image.digest,
            "files": [
                {"name": n, "size": self._entry(n).size, "layer": self._entry(n).layer}
                for n in files
            ],
        }

    def close(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)
