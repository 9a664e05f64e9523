"""An artifact pushed to an OCI registry, read where it is: ``verify oci://REPO@sha256:...``.

The image manifest (fetched by digest, or by tag and then pinned to the digest it has) names
the ``modelstage.json`` layer; that blob must hash to its digest, and every other file is then
checked against it chunk by chunk, read with ranged ``GET``s of its layer, as ``verify`` does
for a directory or an S3 prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .errors import ArtifactError
from .integrity import ReadInto
from .location import ArtifactLocation, Listed
from .manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest
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

if TYPE_CHECKING:
    from .progress import Progress

BLOCK = 8 * 1024 * 1024


class OciArtifact(ArtifactLocation):
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
        layer, h = self._layers[name], hashlib.sha256()
        size = listed.size or 0
        buf = bytearray(min(BLOCK, size))
        for start in range(0, size, BLOCK):
            view = memoryview(buf)[: min(BLOCK, size - start)]
            self._read(layer, start, view)
            h.update(view)
            if progress is not None:
                progress.advance(len(view))
        return h.hexdigest()


def layer_digest(layer: Layer, data: bytes) -> str:
    """The digest of the layer holding ``data`` as ``layer`` (raw, or as a one-file tar)."""
    h = hashlib.sha256()
    if layer.media_type == IMAGE_LAYER:
        h.update(tar_header(layer.name, len(data)))
        h.update(data)
        h.update(tar_trailer(len(data)))
    else:
        h.update(data)
    return "sha256:" + h.hexdigest()
