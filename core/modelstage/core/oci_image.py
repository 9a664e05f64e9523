"""How an artifact is laid out as an OCI image: media types, layers, config, manifest (pure).

One layer per artifact file, uncompressed, titled with the file's name
(``org.opencontainers.image.title``, and ModelPack's ``org.cncf.model.filepath``), so that
pulling the image by titles, or unpacking it, gives exactly the artifact directory. The
modelstage manifest (``modelstage.json``) is a layer like the others and the image
manifest's ``io.modelstage.manifest`` annotation names its digest: a reader fetches it first
and checks every other file against it, as for a directory.

Two forms (``FORMS``):

- ``modelpack`` (default): a CNCF ModelPack: ``artifactType``
  ``application/vnd.cncf.model.manifest.v1+json``, config
  ``application/vnd.cncf.model.config.v1+json``, weight files as
  ``application/vnd.cncf.model.weight.v1.raw``, the others as
  ``application/vnd.cncf.model.weight.config.v1.raw``: each layer's bytes are the file's.
  What KServe, KubeAI and CRI-O's artifact mounts read.
- ``image``: a plain OCI image (image config, ``application/vnd.oci.image.layer.v1.tar``
  layers, each a tar archive of the one file at the image's root). What containerd's image
  volumes, umoci and every runtime unpack.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ArtifactError
from .oci_registry import OCI_MANIFEST

MODEL_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
WEIGHT_RAW = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG_RAW = "application/vnd.cncf.model.weight.config.v1.raw"
IMAGE_CONFIG = "application/vnd.oci.image.config.v1+json"
IMAGE_LAYER = "application/vnd.oci.image.layer.v1.tar"
TITLE = "org.opencontainers.image.title"
FILEPATH = "org.cncf.model.filepath"
MANIFEST_ANNOTATION = "io.modelstage.manifest"
"""Image manifest annotation: the digest of the ``modelstage.json`` layer."""
DIGEST_ANNOTATION = "io.modelstage.digest"
"""Image manifest annotation: the artifact digest."""
OFFSET_ANNOTATION = "io.modelstage.file.offset"
SIZE_ANNOTATION = "io.modelstage.file.size"
"""Layer annotations (``image`` form): where the file's bytes sit in its tar layer."""
TAR_BLOCK = 512
TAR_END = bytes(2 * TAR_BLOCK)
WEIGHT_SUFFIXES = (".safetensors", ".tensors", ".bin", ".pt", ".gguf")


@dataclass(frozen=True)
class ImageForm:
    name: str
    tar: bool
    """Each layer a tar archive of its file (else the file's bytes themselves)."""
    config_type: str
    weight_type: str
    other_type: str
    artifact_type: str | None

    def media_type(self, name: str) -> str:
        return self.weight_type if name.endswith(WEIGHT_SUFFIXES) else self.other_type


FORMS: dict[str, ImageForm] = {
    "modelpack": ImageForm(
        "modelpack", False, MODEL_CONFIG, WEIGHT_RAW, WEIGHT_CONFIG_RAW, MODEL_ARTIFACT
    ),
    "image": ImageForm("image", True, IMAGE_CONFIG, IMAGE_LAYER, IMAGE_LAYER, None),
}
DEFAULT_FORM = "modelpack"


def tar_header(name: str, size: int) -> bytes:
    """The tar header of one regular file (deterministic: mode 0644, owner 0, mtime 0)."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type = size, 0o644, tarfile.REGTYPE  # mtime: 0 by default
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def tar_trailer(size: int) -> bytes:
    """What follows the file's bytes: padding to a tar block, then the end-of-archive."""
    return bytes(-size % TAR_BLOCK) + TAR_END


@dataclass(frozen=True)
class Layer:
    """One pushed layer: the artifact file ``name`` at ``offset`` in blob ``digest``."""

    name: str
    digest: str
    size: int
    """The layer blob's size."""
    media_type: str
    offset: int = 0
    file_size: int = 0

    def descriptor(self, form: ImageForm) -> dict[str, Any]:
        annotations = {TITLE: self.name, FILEPATH: self.name}
        if form.tar:
            annotations[OFFSET_ANNOTATION] = str(self.offset)
            annotations[SIZE_ANNOTATION] = str(self.file_size)
        return {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
            "annotations": annotations,
        }


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def image_config(form: ImageForm, layers: Sequence[Layer], info: Mapping[str, Any]) -> bytes:
    """The config blob: ModelPack's model config, or an OCI image config; ``info`` is the
    modelstage manifest's summary (format, dtype, created, source)."""
    diff_ids = [layer.digest for layer in layers]  # uncompressed layers: digest = DiffID
    if form.config_type == MODEL_CONFIG:  # ModelPack's schema: strings only, no nulls
        descriptor = {
            "createdAt": info.get("createdAt"),
            "name": info.get("source"),
            "revision": info.get("revision"),
        }
        dtype = info.get("dtype")
        config = {"format": info.get("format"), "precision": None if dtype == "auto" else dtype}
        return _canonical(
            {
                "descriptor": {k: str(v) for k, v in descriptor.items() if v},
                "config": {k: str(v) for k, v in config.items() if v},
                "modelfs": {"type": "layers", "diff_ids": diff_ids},
            }
        )
    return _canonical(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": info.get("createdAt"),
            "config": {"Labels": {DIGEST_ANNOTATION: str(info.get("digest"))}},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    )


def image_manifest(
    form: ImageForm,
    config: tuple[str, int],
    layers: Sequence[Layer],
    annotations: Mapping[str, str],
) -> bytes:
    """The image manifest: the commit point of a push (pushed last)."""
    doc: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": form.config_type, "digest": config[0], "size": config[1]},
        "layers": [layer.descriptor(form) for layer in layers],
        "annotations": dict(annotations),
    }
    if form.artifact_type:
        doc["artifactType"] = form.artifact_type
    return _canonical(doc)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ParsedImage:
    digest: str
    config: Descriptor
    layers: tuple[Descriptor, ...]
    annotations: dict[str, str]


def parse_image(body: bytes, digest: str, where: str) -> ParsedImage:
    """An image manifest, checked for what readers rely on; an index or another kind of
    manifest is refused, saying what to pass instead."""
    try:
        doc = json.loads(body)
        if doc.get("mediaType") not in (None, OCI_MANIFEST) or "manifests" in doc:
            raise ArtifactError(
                f"{where}: is an image index or another kind of manifest "
                f"({doc.get('mediaType')}); give the digest of one image manifest"
            )
        config = _descriptor(doc["config"])
        layers = tuple(_descriptor(d) for d in doc["layers"])
        annotations = {str(k): str(v) for k, v in (doc.get("annotations") or {}).items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{where}: not a valid OCI image manifest ({e})") from None
    return ParsedImage(digest, config, layers, annotations)


def _descriptor(d: Mapping[str, Any]) -> Descriptor:
    digest, size = str(d["digest"]), int(d["size"])
    if not digest.startswith("sha256:") or len(digest) != 71 or size < 0:
        raise ValueError(f"bad descriptor {digest!r}")
    notes = {str(k): str(v) for k, v in (d.get("annotations") or {}).items()}
    return Descriptor(str(d["mediaType"]), digest, size, notes)


def artifact_layers(image: ParsedImage, where: str) -> dict[str, Layer]:
    """The artifact's files by name, from a modelstage-written image's layer titles."""
    found: dict[str, Layer] = {}
    for d in image.layers:
        name = d.annotations.get(TITLE)
        if not name or "/" in name or name in (".", ".."):
            raise ArtifactError(f"{where}: layer {d.digest} has no usable file name title")
        offset, size = 0, d.size
        if d.media_type.startswith(IMAGE_LAYER):
            if d.media_type != IMAGE_LAYER:
                raise ArtifactError(f"{where}: layer {name} is compressed; not a modelstage image")
            try:
                offset = int(d.annotations[OFFSET_ANNOTATION])
                size = int(d.annotations[SIZE_ANNOTATION])
            except (KeyError, ValueError):
                raise ArtifactError(
                    f"{where}: layer {name} lacks the modelstage file offset annotations"
                ) from None
            if offset < 0 or size < 0 or offset + size > d.size:
                raise ArtifactError(f"{where}: layer {name} has impossible file offsets")
        if name in found:
            raise ArtifactError(f"{where}: two layers are titled {name}")
        found[name] = Layer(name, d.digest, d.size, d.media_type, offset, size)
    return found
