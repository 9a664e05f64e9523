"""An artifact where it lives, a local directory, an S3 or Azure Blob prefix or an OCI image,
and the one ``verify``.

``parse_location`` tells the spellings apart once (a path, ``file://PATH``,
``s3://BUCKET/PREFIX``, ``az://CONTAINER/PREFIX``, ``oci://REGISTRY/REPO:TAG``, any other
``scheme://``). An ``ArtifactLocation`` reads what every check needs, the same way for every
kind: the manifest, the listing (name, size, ETag), ranges of a file. On top of it,
``verify`` checks an artifact against its manifest (``modelstage verify``, ``prepare``): its
structure (``core.structure``: every file present, of its size, nothing unlisted), then its
content.
``check_files`` and ``verify_content`` are the two halves the loader plugin runs on the files
of one rank. The content of schema-2 files is read in chunks, each hashed as it lands
(``integrity.hash_files``); schema-1 files by one sha256 pass.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import structure
from .errors import ArtifactError, DestinationError
from .formats import AZURE, LOCAL, OCI, S3
from .integrity import VERIFY_WORKERS, FileToHash, HashStats, LocalFile, ReadInto, hash_files
from .manifest import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    check_ranks_present,
    read_manifest,
    read_manifest_bytes,
)
from .oci_image import (
    IMAGE_LAYER,
    MANIFEST_ANNOTATION,
    Layer,
    ParsedImage,
    artifact_layers,
    parse_image,
    tar_header,
    tar_trailer,
)
from .oci_registry import OciReference, RegistryClient, RegistryError, RegistryOptions
from .structure import check_structure

if TYPE_CHECKING:
    from .azure_client import AzureClient, AzureLocation, AzureOptions
    from .progress import Progress
    from .s3_client import S3Client, S3Location, S3Options

HASH_BLOCK = 8 * 1024 * 1024
"""The read size of a schema-1 file's sha256 pass."""


@dataclass(frozen=True)
class Location:
    kind: str
    """``LOCAL``, ``S3``, ``AZURE``, or the URI's scheme when another (``hf``, ``pvc``)."""
    text: str
    """As given."""

    @property
    def path(self) -> Path:
        """A local location's directory (``file://`` removed)."""
        return Path(self.text.removeprefix("file://"))


def parse_location(text: str) -> Location:
    if text.startswith("s3://"):
        return Location(S3, text)
    if text.startswith("az://"):
        return Location(AZURE, text)
    if "://" not in text or text.startswith("file://"):
        return Location(LOCAL, text)
    return Location(text.split("://", 1)[0], text)


@dataclass(frozen=True)
class Listed:
    """One file as the location lists it."""

    size: int | None
    """None when it cannot be stat'ed (a dangling link): as good as missing."""
    etag: str | None = None
    """An object's ETag: every read of it is conditional on it."""


class Sha256Mismatch(ArtifactError):
    """A schema-1 file whose bytes do not hash to the manifest's sha256."""

    def __init__(self, where: str, actual: str, expected: str | None, noun: str) -> None:
        self.where, self.actual, self.expected = where, actual, expected
        super().__init__(f"{where}: sha256 differs from the manifest; the {noun} is corrupt")


class ArtifactLocation(abc.ABC):
    """Where an artifact is, and how its files are read."""

    uri: str
    """For messages: the directory, or the ``s3://BUCKET/PREFIX/`` URI."""
    noun: str
    """What its files are called in messages ("file", "object")."""
    workers: int
    """Reads in flight when its content is hashed."""

    @abc.abstractmethod
    def where(self, name: str) -> str:
        """A file's path or URI, for messages."""

    @abc.abstractmethod
    def read_manifest(self) -> Manifest | None:
        """The manifest, or None when there is none (an incomplete artifact)."""

    @abc.abstractmethod
    def manifest_bytes(self) -> bytes | None:
        """The manifest as stored (what a copy must equal byte for byte), or None when there
        is none; a local file that cannot be read raises ``OSError``."""

    @abc.abstractmethod
    def listing(self) -> dict[str, Listed]:
        """Every file in the artifact, by name."""

    @abc.abstractmethod
    def reader(self, name: str, listed: Listed) -> contextlib.AbstractContextManager[ReadInto]:
        """``read_into(offset, view)`` of one file, while the context lasts."""

    @abc.abstractmethod
    def sha256(self, name: str, listed: Listed, progress: Progress | None = None) -> str:
        """A schema-1 file's sha256, in one sequential pass."""

    def require_manifest(
        self, *, digest: str | None = None, tp: int | None = None, pp: int | None = None
    ) -> Manifest:
        """The manifest, refused when missing, not the one expected or short of a rank."""
        manifest = self.read_manifest()
        if manifest is None:
            raise ArtifactError(f"{self.uri}: no {MANIFEST}; the artifact is incomplete")
        manifest.check_expected(self.uri, digest=digest, tp=tp, pp=pp)
        check_ranks_present(self.uri, manifest)
        return manifest


class LocalArtifact(ArtifactLocation):
    """An artifact in a local directory (a mounted PVC)."""

    noun = "file"
    workers = VERIFY_WORKERS

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.uri = str(self.directory)

    def where(self, name: str) -> str:
        return str(self.directory / name)

    def read_manifest(self) -> Manifest | None:
        return read_manifest(self.directory)

    def manifest_bytes(self) -> bytes | None:
        return read_manifest_bytes(self.directory)

    def require_manifest(
        self, *, digest: str | None = None, tp: int | None = None, pp: int | None = None
    ) -> Manifest:
        if not self.directory.is_dir():
            raise ArtifactError(f"{self.directory}: no such artifact directory")
        return super().require_manifest(digest=digest, tp=tp, pp=pp)

    def listing(self) -> dict[str, Listed]:
        found = {}
        for entry in os.scandir(self.directory):
            try:
                size: int | None = entry.stat().st_size
            except FileNotFoundError:
                size = None
            found[entry.name] = Listed(size)
        return found

    @contextlib.contextmanager
    def reader(self, name: str, listed: Listed) -> Iterator[ReadInto]:
        with LocalFile(self.directory / name) as f:
            yield f.read_into

    def sha256(self, name: str, listed: Listed, progress: Progress | None = None) -> str:
        return sha256_file(self.directory / name, progress)


class S3Artifact(ArtifactLocation):
    """An artifact under an S3 prefix: ranged GETs, each conditional on the ETag listed."""

    noun = "object"

    def __init__(self, location: S3Location, s3: S3Client, *, workers: int = 8) -> None:
        self.location, self.s3, self.workers = location, s3, workers
        self.uri = location.uri

    @staticmethod
    def open(uri: str, options: S3Options | None = None) -> S3Artifact:
        from .s3_client import S3Client, S3Location, S3Options

        location = S3Location.parse(uri)
        if not location.prefix:
            raise ArtifactError(f"{uri}: an artifact needs a prefix (s3://BUCKET/PREFIX/)")
        options = options or S3Options()
        return S3Artifact(
            location,
            S3Client(options, concurrency=options.concurrency),
            workers=options.concurrency,
        )

    def where(self, name: str) -> str:
        return f"s3://{self.location.bucket}/{self.location.key(name)}"

    def call(self, fn: Callable[..., Any], key: str) -> Any:
        """One API call (botocore retries it); a failure is one credential-free error."""
        try:
            return fn()
        except Exception as e:
            if isinstance(e, ArtifactError | DestinationError):
                raise
            raise self.s3.error(e, f"s3://{self.location.bucket}/{key}") from None

    def read_manifest(self) -> Manifest | None:
        raw = self.manifest_bytes()
        return None if raw is None else Manifest.from_json(raw, self.where(MANIFEST))

    def manifest_bytes(self) -> bytes | None:
        return self.get(MANIFEST, MAX_MANIFEST_BYTES + 1)  # one byte more: longer is refused

    def get(self, name: str, limit: int | None = None) -> bytes | None:
        """A whole (small) object, at most ``limit`` bytes of it; None when there is none."""
        from botocore.exceptions import ClientError

        try:
            response = self.s3.client.get_object(
                Bucket=self.location.bucket, Key=self.location.key(name)
            )
            with closing(response["Body"]) as body:
                return bytes(body.read() if limit is None else body.read(limit))
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in ("NoSuchKey", "404"):
                return None
            raise self.s3.error(e, self.where(name)) from None
        except Exception as e:
            raise self.s3.error(e, self.where(name)) from None

    def listing(self) -> dict[str, Listed]:
        prefix = self.location.key("")
        found: dict[str, Listed] = {}
        pages = self.s3.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.location.bucket, Prefix=prefix
        )
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix) :]
                    if name:
                        found[name] = Listed(int(obj["Size"]), str(obj["ETag"]).strip('"'))
        except Exception as e:
            raise self.s3.error(e, self.uri) from None
        return found

    @contextlib.contextmanager
    def reader(self, name: str, listed: Listed) -> Iterator[ReadInto]:
        yield self.read_into(name, listed.etag or "")

    def read_into(self, name: str, etag: str) -> ReadInto:
        """Ranged GETs of ``name`` conditional on ``etag`` (a replaced object fails them)."""
        from .s3_client import get_range_into

        bucket, key = self.location.bucket, self.location.key(name)

        def read_into(offset: int, view: memoryview) -> None:
            try:
                get_range_into(self.s3, bucket, key, etag, offset, [view])
            except Exception as e:
                raise self.s3.error(e, self.where(name)) from None

        return read_into

    def sha256(self, name: str, listed: Listed, progress: Progress | None = None) -> str:
        h = hashlib.sha256()
        kwargs = {"IfMatch": listed.etag} if listed.etag else {}
        try:
            bucket, key = self.location.bucket, self.location.key(name)
            body = self.s3.client.get_object(Bucket=bucket, Key=key, **kwargs)["Body"]
            with closing(body):
                for block in body.iter_chunks(HASH_BLOCK):
                    h.update(block)
                    if progress is not None:
                        progress.advance(len(block))
        except Exception as e:
            raise self.s3.error(e, self.where(name)) from None
        return h.hexdigest()


class AzureArtifact(ArtifactLocation):
    """An artifact under an Azure Blob prefix: ranged reads, each conditional on the ETag
    listed (``If-Match``), so a blob replaced while it is read fails the read."""

    noun = "blob"

    def __init__(self, location: AzureLocation, az: AzureClient, *, workers: int = 8) -> None:
        self.location, self.az, self.workers = location, az, workers
        self.uri = location.uri

    @staticmethod
    def open(uri: str, options: AzureOptions | None = None) -> AzureArtifact:
        from .azure_client import AzureClient, AzureLocation, AzureOptions

        location = AzureLocation.parse(uri)
        if not location.prefix:
            raise ArtifactError(f"{uri}: an artifact needs a prefix (az://CONTAINER/PREFIX/)")
        options = options or AzureOptions.from_env()
        return AzureArtifact(
            location, AzureClient(options, location.container), workers=options.concurrency
        )

    def where(self, name: str) -> str:
        return f"az://{self.location.container}/{self.location.key(name)}"

    def call(self, fn: Callable[..., Any], key: str) -> Any:
        """One API call (the SDK retries it); a failure is one credential-free error."""
        try:
            return fn()
        except Exception as e:
            if isinstance(e, ArtifactError | DestinationError):
                raise
            raise self.az.error(e, f"az://{self.location.container}/{key}") from None

    def read_manifest(self) -> Manifest | None:
        raw = self.manifest_bytes()
        return None if raw is None else Manifest.from_json(raw, self.where(MANIFEST))

    def manifest_bytes(self) -> bytes | None:
        return self.get(MANIFEST, MAX_MANIFEST_BYTES + 1)  # one byte more: longer is refused

    def get(self, name: str, limit: int | None = None) -> bytes | None:
        """A whole (small) blob, at most ``limit`` bytes of it; None when there is none."""
        from .azure_client import get_blob

        try:
            return get_blob(self.az, self.location.key(name), limit)
        except Exception as e:
            raise self.az.error(e, self.where(name)) from None

    def listing(self) -> dict[str, Listed]:
        return {name: Listed(size, etag) for name, (size, etag, _) in self.blobs().items()}

    def blobs(self) -> dict[str, tuple[int, str, dict[str, str]]]:
        """{name: (size, ETag, metadata)} of every blob under the prefix, in one listing."""
        prefix = self.location.key("")
        found: dict[str, tuple[int, str, dict[str, str]]] = {}
        try:
            for blob in self.az.client.list_blobs(name_starts_with=prefix, include=["metadata"]):
                name = str(blob.name)[len(prefix) :]
                if name:
                    etag = str(blob.etag).strip('"')
                    found[name] = (int(blob.size), etag, dict(blob.metadata or {}))
        except Exception as e:
            raise self.az.error(e, self.uri) from None
        return found

    @contextlib.contextmanager
    def reader(self, name: str, listed: Listed) -> Iterator[ReadInto]:
        yield self.read_into(name, listed.etag or "")

    def read_into(self, name: str, etag: str) -> ReadInto:
        """Ranged reads of ``name`` conditional on ``etag`` (a replaced blob fails them)."""
        from .azure_client import get_range_into

        key = self.location.key(name)

        def read_into(offset: int, view: memoryview) -> None:
            try:
                get_range_into(self.az, key, etag, offset, view)
            except Exception as e:
                raise self.az.error(e, self.where(name)) from None

        return read_into

    def sha256(self, name: str, listed: Listed, progress: Progress | None = None) -> str:
        return sha256_ranges(self.read_into(name, listed.etag or ""), listed.size or 0, progress)


class OciArtifact(ArtifactLocation):
    """An artifact pushed to an OCI registry, read where it is. The image manifest (by digest,
    or by tag and then pinned to the digest it has) names the ``modelstage.json`` layer, which
    must hash to its digest; every other file is checked against it chunk by chunk, read with
    ranged GETs of its layer."""
    noun = "layer"

    def __init__(self, ref: OciReference, options: RegistryOptions | None = None) -> None:
        self.ref, self.client = ref, RegistryClient(ref, options)
        self.workers = self.client.options.concurrency
        self.uri = ref.uri
        self._image: ParsedImage | None = None
        self._layers: dict[str, Layer] = {}
        self._loaded = False

    @staticmethod
    def open(uri: str, options: RegistryOptions | None = None) -> OciArtifact:
        try:
            return OciArtifact(OciReference.parse(uri), options)
        except RegistryError as e:
            raise ArtifactError(str(e)) from None

    def image(self) -> ParsedImage | None:
        """The image manifest at the reference, or None when the tag (digest) is absent."""
        if not self._loaded:
            try:
                found = self.client.get_manifest(self.ref.reference)
            except RegistryError as e:
                raise ArtifactError(str(e)) from None
            if found is not None:
                self._image = parse_image(found[0], found[1], self.uri)
                self._layers = artifact_layers(self._image, self.uri)
            self._loaded = True
        return self._image

    @property
    def address(self) -> str | None:
        """``REGISTRY/REPOSITORY@sha256:...`` of the image read, once read."""
        image = self.image()
        return None if image is None else self.ref.pinned(image.digest)

    def where(self, name: str) -> str:
        layer = self._layers.get(name)
        at = f" (layer {layer.digest})" if layer is not None else ""
        return f"{self.uri} {name}{at}"

    def manifest_bytes(self) -> bytes | None:
        image = self.image()
        if image is None:
            return None
        digest = image.annotations.get(MANIFEST_ANNOTATION)
        layer = self._layers.get(MANIFEST)
        if digest is None or layer is None or layer.digest != digest:
            return None
        if layer.file_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{self.where(MANIFEST)}: larger than a manifest may be")
        data = bytearray(layer.file_size)
        self._read(layer, 0, memoryview(data))
        if layer_digest(layer, data) != digest:
            raise ArtifactError(
                f"{self.where(MANIFEST)}: does not hash to its layer digest; the image is "
                "corrupt in the registry"
            )
        return bytes(data)

    def read_manifest(self) -> Manifest | None:
        raw = self.manifest_bytes()
        return None if raw is None else Manifest.from_json(raw, self.where(MANIFEST))

    def listing(self) -> dict[str, Listed]:
        self.image()
        return {n: Listed(layer.file_size, layer.digest) for n, layer in self._layers.items()}

    def _read(self, layer: Layer, offset: int, view: memoryview) -> None:
        try:
            self.client.read_range(layer.digest, layer.offset + offset, view)
        except RegistryError as e:
            raise ArtifactError(str(e)) from None

    @contextlib.contextmanager
    def reader(self, name: str, listed: Listed) -> Iterator[ReadInto]:
        layer = self._layers[name]

        def read_into(offset: int, view: memoryview) -> None:
            self._read(layer, offset, view)

        yield read_into

    def sha256(self, name: str, listed: Listed, progress: Progress | None = None) -> str:
        with self.reader(name, listed) as read_into:
            return sha256_ranges(read_into, listed.size or 0, progress)


def layer_digest(layer: Layer, data: bytes | bytearray) -> str:
    """The digest of the layer holding ``data`` as ``layer`` (raw, or as a one-file tar)."""
    h = hashlib.sha256()
    if layer.media_type == IMAGE_LAYER:
        h.update(tar_header(layer.name, len(data)))
        h.update(data)
        h.update(tar_trailer(len(data)))
    else:
        h.update(data)
    return "sha256:" + h.hexdigest()


def open_artifact(
    text: str,
    s3: S3Options | None = None,
    oci: RegistryOptions | None = None,
    azure: AzureOptions | None = None,
) -> ArtifactLocation:
    """The artifact at a local path, an ``s3://`` or an ``az://`` prefix (Azure settings:
    ``azure``, else the environment's) or an ``oci://`` image; ``SpecError`` for another
    scheme is the caller's to word (``parse_location`` first)."""
    location = parse_location(text)
    if location.kind == S3:
        return S3Artifact.open(text, s3)
    if location.kind == OCI:
        return OciArtifact.open(text, oci)
    if location.kind == AZURE:
        return AzureArtifact.open(text, azure)
    return LocalArtifact(location.path)


def verify(
    location: ArtifactLocation,
    *,
    digest: str | None = None,
    tp: int | None = None,
    hash_content: bool = True,
    show_progress: bool = False,
    pp: int | None = None,
) -> Manifest:
    """Check an artifact against its manifest; ``ArtifactError`` at the first problem: no
    manifest, not the one expected, a file missing or of another size, a file the manifest
    does not list, then (``hash_content``) any byte that does not hash right.
    ``show_progress``: report the hashing (bytes, rate, ETA) on stderr; 140 GB take minutes."""
    manifest = location.require_manifest(digest=digest, tp=tp, pp=pp)
    listing = location.listing()
    names = sorted(manifest.files)
    check_structure(manifest.files, _sizes(listing), location.uri, location.where, location.noun)
    if hash_content:
        progress = None
        if show_progress:
            from .progress import Progress

            progress = Progress(
                manifest.bytes, len(names), label=f"hashing {location.uri}", items="files"
            )
        files = [(n, manifest.files[n], listing[n]) for n in names]
        verify_content(location, files, progress=progress)
        if progress is not None:
            progress.finish()
    return manifest


def verify_directory(
    directory: Path,
    *,
    digest: str | None = None,
    tp: int | None = None,
    hash_content: bool = True,
    show_progress: bool = False,
    pp: int | None = None,
) -> Manifest:
    """``verify`` of a local artifact."""
    return verify(
        LocalArtifact(directory),
        digest=digest,
        tp=tp,
        hash_content=hash_content,
        show_progress=show_progress,
        pp=pp,
    )


def check_files(
    location: ArtifactLocation, manifest: Manifest, names: Sequence[str], listing: dict[str, Listed]
) -> None:
    """Each of ``names`` is present with the size the manifest gives (``FileProblem``)."""
    structure.check_files(manifest.files, names, _sizes(listing), location.where)


def _sizes(listing: dict[str, Listed]) -> dict[str, int | None]:
    return {name: listed.size for name, listed in listing.items()}


def verify_content(
    location: ArtifactLocation,
    files: Sequence[tuple[str, FileEntry, Listed]],
    *,
    workers: int | None = None,
    progress: Progress | None = None,
) -> HashStats:
    """Hash every byte of ``files`` against their entries: schema-2 files chunk by chunk
    (``workers`` reads in flight, each chunk checked as it lands: ``ChunkMismatch`` names it;
    then their roots), schema-1 files by one sha256 pass each (``Sha256Mismatch``)."""
    chunked = [(n, e, listed) for n, e, listed in files if e.digest is not None]
    with contextlib.ExitStack() as stack:
        jobs = []
        for name, entry, listed in chunked:
            read_into = stack.enter_context(location.reader(name, listed))
            want = entry.digest
            assert want is not None
            jobs.append(
                FileToHash(location.where(name), entry.size, read_into, want.chunk_bytes, want)
            )
        digests, stats = hash_files(jobs, workers=workers or location.workers, progress=progress)
    for (name, entry, _), got in zip(chunked, digests, strict=True):
        if got.root != entry.blake3:
            raise ArtifactError(
                f"{location.where(name)}: the manifest's blake3 is not the root "
                "of its chunk hashes; the manifest is corrupt"
            )
    for name, entry, listed in files:
        if entry.digest is not None:
            continue
        actual = location.sha256(name, listed, progress)
        if actual != entry.sha256:
            raise Sha256Mismatch(location.where(name), actual, entry.sha256, location.noun)
        stats.add(entry.size, 0.0)
        if progress is not None:
            progress.tensor_done()
    return stats


def sha256_ranges(read_into: ReadInto, size: int, progress: Progress | None = None) -> str:
    """A schema-1 file's sha256 from ranged reads of ``HASH_BLOCK`` bytes, in order (a
    location without a streaming read: an Azure blob, an image layer)."""
    h = hashlib.sha256()
    buf = memoryview(bytearray(min(HASH_BLOCK, max(size, 1))))
    for offset in range(0, size, HASH_BLOCK):
        view = buf[: min(HASH_BLOCK, size - offset)]
        read_into(offset, view)
        h.update(view)
        if progress is not None:
            progress.advance(len(view))
    return h.hexdigest()


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
            if progress is not None:
                progress.advance(len(block))
    return h.hexdigest()
