"""The loader's "verify" phase: is this the artifact the operator rolled out, for this vLLM?

Runs in every rank before the model is allocated on the device, so a wrong artifact costs
seconds, not a GPU's worth of allocation followed by a KeyError deep inside vLLM. Checks, in
order: the manifest exists (the artifact is complete), its digest and TP are the ones the pod
was given, its format suits the load format, its layout version is the running vLLM's, and
this rank's files are exactly those the manifest lists, with the listed sizes and valid
safetensors headers.

Content: every byte a rank loads is hashed against the manifest (``MODELSTAGE_VERIFY``, on by
default). The plugin's own reader checks each hash chunk as it lands (``content_checker``);
where bytes move through a reader the plugin does not own (vLLM's Run:ai streamer), or the
artifact predates chunk hashes (schema 1: one sha256 per file), ``verify_content`` hashes the
files in a pass before loading. Either way a mismatch refuses the load before the engine
serves, naming the file, the chunk and both hashes.

Torch-free and vLLM-free, so the refusals are unit-tested without starting vLLM.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from modelstage.core.errors import ArtifactError, CheckpointError, DestinationError, SpecError
from modelstage.core.formats import plugin_load_formats
from modelstage.core.integrity import ChunkChecker, ChunkMismatch, FileDigest, HashStats, ReadInto
from modelstage.core.integrity import blake3_module as blake3_module
from modelstage.core.layouts import DEFAULT_VLLM_VERSION, layout_for
from modelstage.core.location import (
    ArtifactLocation,
    Listed,
    LocalArtifact,
    S3Artifact,
    Sha256Mismatch,
    check_files,
)
from modelstage.core.location import verify_content as location_verify_content
from modelstage.core.manifest import MANIFEST, FileEntry, Manifest
from modelstage.core.pipeline_parallel import (
    PARTITION_ENV,
    layer_partition,
    parse_layer_partition,
    spell_layer_partition,
)
from modelstage.core.s3_client import S3Client, S3Location
from modelstage.core.safetensors_format import MAX_HEADER_BYTES, SafetensorsHeader, read_header
from modelstage.core.structure import FileProblem

from .settings import ENV_VERIFY, PluginSettings


@dataclass(frozen=True)
class RankFile:
    name: str
    """The name in the manifest."""
    location: str
    """Its path, or its s3:// URI."""
    size: int
    header: SafetensorsHeader
    entry: FileEntry
    """What the manifest says of it: size and content hashes."""
    etag: str | None = None
    """For objects: the ETag seen when verifying; every read is conditional on it."""
    prefix: bytes | None = None
    """For objects: the checked chunks that hold the header, kept so the reader need not
    fetch them again."""

    @property
    def path(self) -> Path:
        """A local file's path."""
        return Path(self.location)


@dataclass(frozen=True)
class VerifiedArtifact:
    location: str
    """The directory, or the s3:// prefix URI (with its trailing slash)."""
    manifest: Manifest
    files: tuple[RankFile, ...]
    """The files this rank reads, in load order (part number for per-rank formats)."""
    artifact: ArtifactLocation
    """Where it is, to read it again the way it was verified."""
    node_cache: str = ""
    """``hit`` when these are the files of the node-local copy, ``miss`` when a node cache was
    configured but the artifact is read instead, ``corrupt`` when the node copy failed its
    verification and the artifact is read instead, "" without a node cache."""

    @property
    def s3(self) -> S3Client | None:
        """For S3 artifacts: the client that verified it, to read with the same settings."""
        return self.artifact.s3 if isinstance(self.artifact, S3Artifact) else None

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def tensor_names(self) -> set[str]:
        return {name for f in self.files for name in f.header.tensors}


REFUSING = "modelstage: refusing to load "


def refuse(where: str, reason: str) -> ArtifactError:
    """The one shape of every refusal, so that operators can grep pod logs for it."""
    return ArtifactError(f"{REFUSING}{where}: {reason}")


def check_manifest(
    manifest: Manifest,
    where: str,
    *,
    load_format: str,
    settings: PluginSettings,
    running_tp: int,
    vllm_version: str,
    running_pp: int = 1,
) -> None:
    """Refuse a manifest that is not the one this pod was told to load, with what to do."""
    try:
        manifest.check_expected(where, digest=settings.digest, tp=running_tp, pp=running_pp)
    except ArtifactError as e:
        raise refuse(where, str(e).removeprefix(f"{where}: ")) from None
    if settings.tp is not None and settings.tp != running_tp:
        raise refuse(
            where,
            f"{settings.tp} is the tensor parallel size in MODELSTAGE_TP, but vLLM runs "
            f"{running_tp}; set --tensor-parallel-size {settings.tp} or re-stage",
        )
    accepted = plugin_load_formats().get(load_format, ())
    if manifest.format not in accepted:
        raise refuse(
            where,
            f"artifact format {manifest.format!r} cannot be loaded with --load-format "
            f"{load_format}; it loads {', '.join(accepted) or 'nothing'}",
        )
    if settings.format is not None and settings.format != manifest.format:
        raise refuse(
            where,
            f"artifact format is {manifest.format!r}, but MODELSTAGE_FORMAT says "
            f"{settings.format!r}; point --model at the artifact the operator staged",
        )
    try:
        layout = layout_for(vllm_version)
    except SpecError as e:
        raise refuse(where, f"{e}; run a vLLM version modelstage supports") from None
    if manifest.layoutVersion != layout.layout_version:
        raise refuse(
            where,
            f"artifact layout is {manifest.layoutVersion} (staged for vLLM "
            f"{manifest.vllmVersion}), but vLLM {vllm_version} needs "
            f"{layout.layout_version}; re-stage with --vllm-version {layout.vllm_version}",
        )
    if manifest.pipelineParallelSize > 1 and not layout.pp_rank_files:
        raise refuse(
            where,
            f"vLLM {vllm_version} names a rank's files by its tensor-parallel rank alone, so "
            f"the {manifest.pipelineParallelSize} pipeline stages of this artifact would read "
            f"one file; serve it with vLLM {DEFAULT_VLLM_VERSION}",
        )


def verify_local(
    directory: Path,
    *,
    load_format: str,
    settings: PluginSettings,
    running_tp: int,
    vllm_version: str,
    rank_glob: str | None,
    running_pp: int = 1,
) -> VerifiedArtifact:
    """Verify a local artifact for one rank; ``rank_glob`` None means every safetensors file
    (the Hugging Face layout of ``runai_streamer``, split by vLLM at load)."""
    where = str(directory)
    if not directory.is_dir():
        raise refuse(where, "no such artifact directory; check --model and the volume mount")
    location = LocalArtifact(directory)
    try:
        manifest = location.read_manifest()
        listing = location.listing()
    except ArtifactError as e:
        raise refuse(where, str(e)) from None
    return _verify_rank(
        location,
        manifest,
        listing,
        load_format=load_format,
        settings=settings,
        running_tp=running_tp,
        vllm_version=vllm_version,
        pattern=rank_glob or "*.safetensors",
        running_pp=running_pp,
    )


def verify_s3(
    uri: str,
    s3: S3Client,
    *,
    load_format: str,
    settings: PluginSettings,
    running_tp: int,
    vllm_version: str,
    rank_glob: str,
    running_pp: int = 1,
) -> VerifiedArtifact:
    """Verify this rank's objects of an S3 artifact: the manifest object first, one listing
    for sizes, ETags and unlisted objects, then each object's header (one small ranged GET).
    The ETags pin what was verified: the reader's GETs are conditional on them."""
    try:
        location = S3Artifact(S3Location.parse(uri), s3)
    except SpecError as e:
        raise refuse(uri, str(e)) from None
    try:
        manifest = location.read_manifest()
        listing = location.listing()
    except DestinationError as e:
        raise _s3_refusal(e, location.uri) from None
    return _verify_rank(
        location,
        manifest,
        listing,
        load_format=load_format,
        settings=settings,
        running_tp=running_tp,
        vllm_version=vllm_version,
        pattern=rank_glob,
        running_pp=running_pp,
    )


def _verify_rank(
    location: ArtifactLocation,
    manifest: Manifest | None,
    listing: dict[str, Listed],
    *,
    load_format: str,
    settings: PluginSettings,
    running_tp: int,
    vllm_version: str,
    pattern: str,
    running_pp: int = 1,
) -> VerifiedArtifact:
    """The manifest is the one expected, this rank's files are there, whole, with headers
    that parse (and, when verifying, whose chunks hash right)."""
    where = location.uri
    manifest = _expected(
        manifest, where, load_format, settings, (running_tp, running_pp), vllm_version
    )
    _hash_available(where, settings)
    present = (n for n in listing if n != MANIFEST)
    names = _rank_names(where, manifest, present, pattern)
    files = tuple(_verify_file(location, n, manifest, listing, settings.verify) for n in names)
    return VerifiedArtifact(where, manifest, _no_duplicates(where, files), location)


def _expected(
    manifest: Manifest | None,
    where: str,
    load_format: str,
    settings: PluginSettings,
    running: tuple[int, int],
    vllm_version: str,
) -> Manifest:
    """The manifest, checked against what this pod runs (``running``: TP, PP)."""
    if manifest is None:
        raise refuse(
            where,
            f"no {MANIFEST}: the artifact is incomplete or was not staged by modelstage; "
            "wait for staging to finish or run `modelstage prepare` to find out why",
        )
    check_manifest(
        manifest,
        where,
        load_format=load_format,
        settings=settings,
        running_tp=running[0],
        vllm_version=vllm_version,
        running_pp=running[1],
    )
    return manifest


def check_layer_partition(
    where: str, manifest: Manifest, num_layers: int, serving: str | None
) -> None:
    """Refuse a per-rank artifact whose pipeline stages hold other layers than the ones vLLM
    builds here: its partition (``VLLM_PP_LAYER_PARTITION``, ``serving``; None: unset)
    resolved against the model's layers must be the staged one."""
    pp = manifest.pipelineParallelSize
    if pp == 1:
        return
    staged_text = manifest.pipelineLayerPartition
    try:
        staged = layer_partition(
            num_layers, pp, parse_layer_partition(staged_text) if staged_text else None
        )
        running = layer_partition(
            num_layers, pp, parse_layer_partition(serving) if serving else None
        )
    except SpecError as e:
        raise refuse(where, f"{PARTITION_ENV}: {e}") from None
    if staged != running:
        raise refuse(
            where,
            f"its pipeline stages hold {spell_layer_partition(staged)} decoder layers, but vLLM "
            f"builds {spell_layer_partition(running)} here ({PARTITION_ENV}="
            f"{serving or 'unset'}); set {PARTITION_ENV}={staged_text or 'unset'} as staged, "
            "or re-stage with --pp-layer-partition (spec.parallelism.layerPartition of a "
            "ModelDeployment)",
        )


def _hash_available(where: str, settings: PluginSettings) -> None:
    """Verifying needs the ``blake3`` package: refuse up front, saying how to go on."""
    if not settings.verify:
        return
    try:
        blake3_module()
    except ArtifactError as e:
        raise refuse(where, f"{e}; or set {ENV_VERIFY}=0 to load it unverified") from None


def _rank_names(where: str, manifest: Manifest, present: Iterable[str], pattern: str) -> list[str]:
    """The manifest's files this rank loads, in part order; refuse files the glob would also
    match that the manifest does not list (vLLM's stock loaders would load them)."""
    glob = _glob(pattern)
    listed = (n for n in manifest.files if glob.fullmatch(n))
    names = sorted(listed, key=_part_key(pattern))
    if not names:
        raise refuse(where, f"the manifest lists no file matching {pattern!r}")
    matching = (n for n in present if glob.fullmatch(n))
    unlisted = sorted(n for n in matching if n not in manifest.files)
    if unlisted:
        raise refuse(
            where,
            f"{', '.join(unlisted[:3])} match {pattern!r} but are not in the manifest; "
            "vLLM would load them; remove them or re-stage",
        )
    return names


def _no_duplicates(where: str, files: tuple[RankFile, ...]) -> tuple[RankFile, ...]:
    seen: dict[str, str] = {}
    for f in files:
        for tensor in f.header.tensors:
            if tensor in seen:
                raise refuse(
                    where,
                    f"tensor {tensor!r} is in both {seen[tensor]} and "
                    f"{f.name}; re-stage the artifact",
                )
            seen[tensor] = f.name
    return files


HEADER_PREFIX_BYTES = 256 * 1024
"""Bytes fetched by the first read of a file's header: a rank file's header is smaller, so
the length and the JSON come in one request."""


def _verify_file(
    location: ArtifactLocation,
    name: str,
    manifest: Manifest,
    listing: dict[str, Listed],
    check_content: bool,
) -> RankFile:
    """One rank file: listed with its size, and its header parsed (from chunks checked
    against their hashes first, when verifying)."""
    where, entry = location.where(name), manifest.files[name]
    try:
        check_files(location, manifest, [name], listing)
    except FileProblem as e:
        raise refuse(e.where, f"{e.reason}; re-stage") from None
    listed = listing[name]
    kept = None
    try:
        with location.reader(name, listed) as read_into:
            read = _reads(read_into)
            digest = entry.digest if check_content else None
            if digest is not None:
                kept = checked_prefix(where, digest, read)
                header = read_header(where, entry.size, _served(kept))
            else:
                header = read_header(where, entry.size, _prefixed(read, entry.size))
    except ChunkMismatch as e:
        raise refuse(where, f"{e.reason}: re-stage it") from None
    except CheckpointError as e:
        raise refuse(where, f"{e}; re-stage") from None
    except DestinationError as e:
        raise _s3_refusal(e, where) from None
    except ArtifactError:
        raise
    except OSError as e:
        raise refuse(where, f"cannot read: {e.strerror or e}") from None
    if not isinstance(location, S3Artifact):
        kept = None  # a local reader reads the header again, from the page cache
    return RankFile(name, where, entry.size, header, entry, listed.etag, kept)


def _reads(read_into: ReadInto) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        buf = bytearray(length)
        read_into(offset, memoryview(buf))
        return bytes(buf)

    return read


def _prefixed(read: Callable[[int, int], bytes], size: int) -> Callable[[int, int], bytes]:
    """``read`` with the file's first ``HEADER_PREFIX_BYTES`` fetched once and served."""
    prefix = read(0, min(size, HEADER_PREFIX_BYTES)) if size else b""

    def served(offset: int, length: int) -> bytes:
        if offset + length <= len(prefix):
            return prefix[offset : offset + length]
        return read(offset, length)

    return served


def _s3_refusal(e: DestinationError, where: str) -> ArtifactError:
    """The S3 client's one credential-free line about ``where``, as a refusal."""
    return refuse(where, str(e).removeprefix(f"{where}: "))


def _glob(pattern: str) -> re.Pattern[str]:
    """vLLM's part-file glob as a regex whose ``*`` stays within one name (``fnmatch``'s
    ``*`` would also match ``/``: ``model-rank-0-part-*`` would take ``../x/part-0``)."""
    return re.compile(re.escape(pattern).replace(r"\*", "([^/]*)"))


def _served(data: bytes) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        return data[offset : offset + length]

    return read


def checked_prefix(where: str, digest: FileDigest, read: Callable[[int, int], bytes]) -> bytes:
    """The whole chunks that hold a file's header (one, for any usual header), read and
    checked against their hashes (``ChunkMismatch``)."""
    checker = ChunkChecker([(where, digest)])
    data = bytearray()
    needed = min(8, digest.size)
    for index in range(len(digest.chunks)):
        if len(data) >= needed:
            break
        lo, hi = digest.range(index)
        piece = read(lo, hi - lo)
        checker.check(0, lo, [memoryview(piece)])
        data += piece
        if len(data) >= 8:
            length = int.from_bytes(data[:8], "little")
            needed = min(8 + min(length, MAX_HEADER_BYTES), digest.size)
    return bytes(data)


def content_checker(verified: VerifiedArtifact) -> ChunkChecker | None:
    """The checker of this rank's files for the plugin's reader, in load order; None when some
    file has no chunk hashes (a schema-1 artifact: ``verify_content`` hashes it instead)."""
    files = []
    for f in verified.files:
        digest = f.entry.digest
        if digest is None:
            return None
        files.append((f.location, digest))
    return ChunkChecker(files)


def verify_content(verified: VerifiedArtifact, *, workers: int | None = None) -> HashStats:
    """Hash every byte of this rank's files against the manifest, in a pass of its own: for
    loads whose bytes the plugin's reader does not move, and for schema-1 artifacts (sha256).
    Chunked files are read chunk by chunk (``workers`` reads at once: by default one on a
    local disk, 8 GETs on S3), each checked as it lands. Refuses at the first mismatch."""
    files = [(f.name, f.entry, Listed(f.size, f.etag)) for f in verified.files]
    try:
        return location_verify_content(verified.artifact, files, workers=workers)
    except ChunkMismatch as e:
        raise refuse(e.where, f"{e.reason}: re-stage it") from None
    except Sha256Mismatch as e:
        raise refuse(
            e.where,
            f"sha256 is {e.actual}, the manifest says {e.expected}; the file "
            "is corrupt: re-stage it",
        ) from None
    except DestinationError as e:
        where, _, reason = str(e).partition(": ")  # the S3 client names the object it read
        raise refuse(where, reason) from None
    except ArtifactError as e:
        raise refuse(verified.location, str(e)) from None
    except OSError as e:
        raise refuse(verified.location, f"cannot read: {e}") from None


def _part_key(pattern: str) -> Callable[[str], tuple[int, str]]:
    """Sort part files by the number the glob's ``*`` matched (part 10 after part 9)."""
    regex = _glob(pattern)

    def key(name: str) -> tuple[int, str]:
        m = regex.fullmatch(name)
        captured = m.group(1) if m and m.groups() else name
        return (int(captured), name) if captured.isdigit() else (-1, name)

    return key
