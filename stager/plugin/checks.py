"""The loader's "verify" phase: is this the artifact the operator rolled out, for this vLLM?

Runs in every rank before the model is allocated on the device, so a wrong artifact costs
seconds, not a GPU's worth of allocation followed by a KeyError deep inside vLLM. Checks, in
order: the manifest exists (the artifact is complete), its digest and TP are the ones the pod
was given, its format suits the load format, its layout version is the running vLLM's, and
this rank's files are exactly those the manifest lists, with the listed sizes and valid
safetensors headers. Hashing content is opt-in (``MODELSTAGE_VERIFY_HASH=1``): the
initContainer verified the artifact already, and hashing reads every byte twice.

Torch-free and vLLM-free, so the refusals are unit-tested without starting vLLM.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArtifactError, CheckpointError, SpecError
from ..layouts import layout_for
from ..manifest import MANIFEST, Manifest, read_manifest, sha256_file
from ..safetensors_format import SafetensorsHeader, read_local_header
from .settings import PluginSettings

LOAD_FORMATS: dict[str, tuple[str, ...]] = {
    "modelstage_sharded_state": ("sharded_state", "runai_streamer_sharded"),
    "modelstage_runai_streamer_sharded": ("sharded_state", "runai_streamer_sharded"),
    "modelstage_runai_streamer": ("runai_streamer",),
}
"""Plugin load format -> artifact formats (manifest ``format``) it can load. The per-rank
formats share one file layout, so either loader reads either artifact."""


@dataclass(frozen=True)
class RankFile:
    path: Path
    size: int
    header: SafetensorsHeader


@dataclass(frozen=True)
class VerifiedArtifact:
    directory: Path
    manifest: Manifest
    files: tuple[RankFile, ...]
    """The files this rank reads, in load order (part number for per-rank formats)."""

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def tensor_names(self) -> set[str]:
        return {name for f in self.files for name in f.header.tensors}


def refuse(where: str, reason: str) -> ArtifactError:
    """The one shape of every refusal, so that operators can grep pod logs for it."""
    return ArtifactError(f"modelstage: refusing to load {where}: {reason}")


def check_manifest(
    manifest: Manifest,
    where: str,
    *,
    load_format: str,
    settings: PluginSettings,
    running_tp: int,
    vllm_version: str,
) -> None:
    """Refuse a manifest that is not the one this pod was told to load, with what to do."""
    try:
        manifest.check_expected(where, digest=settings.digest, tp=running_tp)
    except ArtifactError as e:
        raise refuse(where, str(e).removeprefix(f"{where}: ")) from None
    if settings.tp is not None and settings.tp != running_tp:
        raise refuse(
            where,
            f"{settings.tp} is the tensor parallel size in MODELSTAGE_TP, but vLLM runs "
            f"{running_tp}; set --tensor-parallel-size {settings.tp} or re-stage",
        )
    accepted = LOAD_FORMATS.get(load_format, ())
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


def verify_local(
    directory: Path,
    *,
    load_format: str,
    settings: PluginSettings,
    running_tp: int,
    vllm_version: str,
    rank_glob: str | None,
) -> VerifiedArtifact:
    """Verify a local artifact for one rank; ``rank_glob`` None means every safetensors file
    (the Hugging Face layout of ``runai_streamer``, split by vLLM at load)."""
    where = str(directory)
    if not directory.is_dir():
        raise refuse(where, "no such artifact directory; check --model and the volume mount")
    try:
        manifest = read_manifest(directory)
    except ArtifactError as e:
        raise refuse(where, str(e)) from None
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
        running_tp=running_tp,
        vllm_version=vllm_version,
    )
    pattern = rank_glob or "*.safetensors"
    listed = (n for n in manifest.files if fnmatch.fnmatchcase(n, pattern))
    names = sorted(listed, key=_part_key(pattern))
    if not names:
        raise refuse(where, f"the manifest lists no file matching {pattern!r}")
    unlisted = sorted(p.name for p in directory.glob(pattern) if p.name not in manifest.files)
    if unlisted:
        raise refuse(
            where,
            f"{', '.join(unlisted[:3])} match {pattern!r} but are not in the manifest; "
            "vLLM would load them; remove them or re-stage",
        )
    files = tuple(_verify_file(directory / n, manifest, settings.verify_hash) for n in names)
    seen: dict[str, Path] = {}
    for f in files:
        for tensor in f.header.tensors:
            if tensor in seen:
                raise refuse(where, f"tensor {tensor!r} is in both {seen[tensor].name} and "
                             f"{f.path.name}; re-stage the artifact")  # fmt: skip
            seen[tensor] = f.path
    return VerifiedArtifact(directory, manifest, files)


def _verify_file(path: Path, manifest: Manifest, hash_content: bool) -> RankFile:
    entry = manifest.files[path.name]
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise refuse(str(path), "listed in the manifest but missing; re-stage") from None
    if size != entry.size:
        raise refuse(str(path), f"{size} bytes, the manifest says {entry.size}; re-stage")
    try:
        header = read_local_header(path)
    except CheckpointError as e:
        raise refuse(str(path), f"{e}; re-stage") from None
    if hash_content and sha256_file(path) != entry.sha256:
        raise refuse(str(path), "sha256 differs from the manifest; the file is corrupt")
    return RankFile(path, size, header)


def _part_key(pattern: str) -> Callable[[str], tuple[int, str]]:
    """Sort part files by the number the glob's ``*`` matched (part 10 after part 9)."""
    regex = re.compile(re.escape(pattern).replace(r"\*", "(.*)"))

    def key(name: str) -> tuple[int, str]:
        m = regex.fullmatch(name)
        captured = m.group(1) if m and m.groups() else name
        return (int(captured), name) if captured.isdigit() else (-1, name)

    return key
