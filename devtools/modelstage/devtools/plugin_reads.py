"""The loader plugin's reader, driven the way the benchmark (and its tests) read rank files:
outside vLLM, into host tensors. Dev tooling: serving pods never carry it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def read_files_for_bench(
    files: Sequence[Path], params: Mapping[str, Any] | None = None, verify: bool = False
) -> None:
    """``modelstage bench``'s plugin rows: the rank files into ``params`` (name -> tensor, as
    vLLM's model holds them before loading; fresh host tensors when None), through the
    reader with its default settings; what the stock row does with ``safe_open``. ``verify``:
    every byte checked against the chunk hashes of the manifest beside the files, as the
    plugin does by default (the manifest is read first, as in the verify phase)."""
    import torch
    from modelstage.core.errors import ArtifactError
    from modelstage.core.integrity import ChunkChecker
    from modelstage.core.manifest import read_manifest
    from modelstage.core.safetensors_format import TensorInfo, read_local_header
    from modelstage.plugin.reader import TORCH_DTYPES, PipelinedReader, Target, flat_bytes
    from modelstage.plugin.settings import PluginSettings, local_reads

    headers = [(Path(f), read_local_header(Path(f))) for f in files]
    checker = None
    if verify:
        manifest = read_manifest(Path(files[0]).parent) if files else None
        digests = [manifest.files[p.name].digest if manifest else None for p, _ in headers]
        if any(d is None for d in digests):
            raise ArtifactError("verified reads need a schema-2 manifest beside the files")
        checker = ChunkChecker(
            [(str(p), d) for (p, _), d in zip(headers, digests, strict=True) if d is not None]
        )
    chunk_bytes, depth = local_reads(PluginSettings(), checker.read_bytes(1) if checker else None)
    reader = PipelinedReader(chunk_bytes=chunk_bytes, depth=depth, device=torch.device("cpu"))

    def into(info: TensorInfo) -> Target:
        if params is not None:
            return Target(flat_bytes(params[info.name]))
        return Target(flat_bytes(torch.empty(info.shape, dtype=TORCH_DTYPES[info.dtype])))

    reader.read(headers, into, checker)
